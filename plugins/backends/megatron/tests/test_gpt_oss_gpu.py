"""gpt-oss in the megatron trainer on a CUDA GPU (``pytest -m gpu``): a gpt-oss-shaped model
(sliding-window and full layers, sinks, the default YaRN of gpt-oss' config, biased experts with
the clamped SwiGLU) on rows longer than the window: fp32 log-probs equal transformers', the bf16
compute copy stays close, and bf16 steps (SDPA with the sink column's gradient) lower the loss and
move the sinks, the expert biases and the router."""
import pytest
import torch
from frontier import Spec, hf_model
from helpers import batch, hf_logprobs
from test_gpu import make, report

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# a window of 16 over rows of up to ~100 tokens; rope_parameters: gpt-oss' own default (YaRN x32)
SHAPE = {"hidden_size": 512, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
         "vocab_size": 2048, "max_position_embeddings": 131072, "sliding_window": 16, "swiglu_limit": 7.0,
         "layer_types": ["sliding_attention", "full_attention"] * 2, "rope_parameters": None}


def test_gpt_oss_matches_transformers_and_trains_in_bf16():
    spec = Spec("gpt_oss", **SHAPE)
    b = batch(rows=8, vocab=SHAPE["vocab_size"], prompt=40, response=60)
    tr = make(spec, precision="fp32", lr=1e-3)
    assert tr.arch.yarn_factor == 32.0 and tr.arch.window == 16
    hf = hf_model("gpt_oss", **SHAPE).cuda().eval()
    hf.load_state_dict(dict(tr.named_weights()))
    m = b.loss_mask.bool()
    ref = hf_logprobs(hf, b)
    d32 = (tr.logprobs(b) - ref)[m].abs()
    report("gpt_oss_fp32_megatron_vs_hf_max_abs", d32.max())
    assert d32.max() < 1e-3
    tr.cfg = tr.cfg.model_copy(update={"precision": "bf16"})
    d16 = (tr.logprobs(b) - ref)[m].abs()
    report("gpt_oss_bf16_megatron_vs_hf_fp32_mean_abs", d16.mean())
    assert d16.mean() < 0.05
    before = {k: v.clone() for k, v in tr.named_weights()}
    losses = [tr.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))["loss"]
              for _ in range(5)]
    report("gpt_oss_bf16_loss_first", losses[0])
    report("gpt_oss_bf16_loss_last", losses[-1])
    assert losses[-1] < losses[0]
    changed = {k for k, v in tr.named_weights() if not torch.equal(v, before[k])}
    for part in ("self_attn.sinks", "experts.gate_up_proj_bias", "mlp.router.bias", "self_attn.o_proj.bias"):
        assert any(k.endswith(part) for k in changed), part
