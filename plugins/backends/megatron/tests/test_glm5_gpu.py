"""On a CUDA GPU (``pytest -m gpu``): GLM-5 (``frontier.py``: MLA with DeepSeek sparse attention's
indexer) in the megatron trainer on megatron-core's CUDA path, over rows long enough that the
indexer drops keys: fp32 log-probs vs transformers on the GPU, and bf16 steps through the compute
copy lower the loss while the indexer stays frozen."""
import pytest
import torch
from frontier import Spec, hf_model
from helpers import batch, hf_logprobs
from miles_plugin_megatron.config import MegatronConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_glm5_matches_transformers_and_trains_in_bf16():
    import megatron.core
    from miles_plugin_megatron.trainer import MegatronTrainer

    print(f"MEASURED megatron_core_version = {megatron.core.__version__}")
    tr = MegatronTrainer(MegatronConfig(device="cuda", precision="fp32", lr=1e-3), spec=Spec("glm_moe_dsa"),
                         tokenizer=None, seed=0, total_steps=10)
    b = batch(rows=8, prompt=12, response=12)  # up to 26 tokens, 6 kept per query
    mask = b.loss_mask.bool()
    fp32 = tr.logprobs(b)
    diff = (fp32 - hf_logprobs(hf_model("glm_moe_dsa").cuda(), b))[mask].abs().max()
    print(f"MEASURED glm_moe_dsa_fp32_megatron_vs_hf_max_abs = {float(diff):.3g}")
    assert diff < 1e-3
    before = {k: v.clone() for k, v in tr.named_weights() if ".indexer." in k}
    tr.cfg = tr.cfg.model_copy(update={"precision": "bf16"})
    losses = [tr.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))["loss"] for _ in range(5)]
    print(f"MEASURED glm_moe_dsa_bf16_losses = {losses}")
    assert losses[-1] < losses[0]
    after = dict(tr.named_weights())
    assert all(torch.equal(after[k], v) for k, v in before.items())
