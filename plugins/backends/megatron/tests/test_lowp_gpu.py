"""On a CUDA GPU (``pytest -m gpu``): trainer megatron with trainer.precision fp8 runs its linears'
GEMMs through ``torch._scaled_mm`` (libs/lowp's blockwise path) on the bf16 compute copy; its
log-probs track the fsdp2 trainer's numerics (the HF model with libs/lowp's rounding, in bf16), its
loss goes down, and mxfp8 / INT4 QAT train too."""
import pytest
import torch
from helpers import Spec, batch
from miles_plugin_megatron.config import MegatronConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# every fused matrix a multiple of 128 rows and columns: the blockwise GEMM's own shapes
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 1000}


def make(spec, **cfg):
    from miles_plugin_megatron.trainer import MegatronTrainer

    return MegatronTrainer(MegatronConfig(device="cuda", lr=1e-3, grad_clip=None, **cfg), spec=spec,
                           tokenizer=None, seed=0, total_steps=10)


def hf_lp(model, b):
    with torch.no_grad():
        logits = model(input_ids=b.input_ids.cuda(), attention_mask=b.attention_mask.cuda(),
                       position_ids=b.position_ids.cuda()).logits[:, b.prompt_len - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, b.input_ids[:, b.prompt_len:, None].cuda())[..., 0].cpu()


def test_fp8_scaled_mm_path(monkeypatch):
    from miles_lowp import fp8 as f8
    from miles_lowp.linear import convert

    assert f8.scaled_mm_supported(torch.device("cuda"))
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = Spec("qwen3", **SHAPE)
    b = batch(rows=8, vocab=1000, prompt=20, response=30)
    tr = make(spec, precision="fp8")
    got = tr.logprobs(b)
    assert calls, "fp8 linears did not reach torch._scaled_mm"
    named = dict(tr.named_weights())
    low, plain = (spec.build_model(None).cuda().eval() for _ in range(2))
    for m in (low, plain):
        m.load_state_dict(named)
    convert(low, "fp8")
    m = b.loss_mask.bool()
    d_low = (got - hf_lp(low.to(torch.bfloat16), b))[m].abs()
    d_plain = (got - hf_lp(plain, b))[m].abs()
    print(f"MEASURED megatron_fp8_vs_hf_lowp_bf16_max_abs = {float(d_low.max()):.4g}")
    print(f"MEASURED megatron_fp8_vs_hf_fp32_max_abs = {float(d_plain.max()):.4g}")
    assert d_low.mean() < d_plain.mean()  # it computes the fp8 rounding, not full precision
    losses = [tr.train_step(b, lambda mb, lp: (-mb.token_mean(lp), {}))["loss"] for _ in range(3)]
    assert losses[2] < losses[0]


@pytest.mark.parametrize("over", [{"precision": "mxfp8"}, {"qat": "int4"}])
def test_mxfp8_and_int4_qat_train(over):
    tr = make(Spec("qwen3", **SHAPE), **over)
    b = batch(rows=8, vocab=1000, prompt=20, response=30)
    losses = [tr.train_step(b, lambda mb, lp: (-mb.token_mean(lp), {}))["loss"] for _ in range(3)]
    assert losses[2] < losses[0]
    assert {k for k, _ in tr.packed_weights()} >= {k + s for k in tr.packed_formats
                                                   for s in (["_packed"] if "qat" in over else [""])}
