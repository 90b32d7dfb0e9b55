"""On a CUDA GPU (``pytest -m gpu``): Qwen3-Next and Qwen3.5 MoE (``frontier.py``) in the megatron
trainer on megatron-core's CUDA path: fp32 log-probs vs transformers on the GPU, bf16 steps through
the compute copy lower the loss, and compiled layers (the DeltaNet module included) score as the
uncompiled ones."""
import pytest
import torch
from frontier import GATED, Spec, hf_model
from helpers import batch, hf_logprobs
from miles_plugin_megatron.config import MegatronConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", GATED)
def test_gated_families_match_transformers_and_train_in_bf16(family):
    from miles_plugin_megatron.trainer import MegatronTrainer

    tr = MegatronTrainer(MegatronConfig(device="cuda", precision="fp32", lr=1e-3), spec=Spec(family), tokenizer=None,
                         seed=0, total_steps=10)
    b = batch(rows=8)
    mask = b.loss_mask.bool()
    fp32 = tr.logprobs(b)
    diff = (fp32 - hf_logprobs(hf_model(family).cuda(), b))[mask].abs().max()
    print(f"MEASURED {family}_fp32_megatron_vs_hf_max_abs = {float(diff):.3g}")
    assert diff < 1e-3
    tr.cfg = tr.cfg.model_copy(update={"precision": "bf16"})
    losses = [tr.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))["loss"] for _ in range(5)]
    print(f"MEASURED {family}_bf16_losses = {losses}")
    assert losses[-1] < losses[0]


def test_compiled_layers_score_as_uncompiled():
    from miles_plugin_megatron.trainer import MegatronTrainer

    b = batch(rows=8)
    mask = b.loss_mask.bool()
    plain, compiled = (MegatronTrainer(MegatronConfig(device="cuda", precision="bf16", compile=c),
                                       spec=Spec("qwen3_next"), tokenizer=None, seed=0).logprobs(b)
                       for c in (False, True))
    diff = (plain - compiled)[mask].abs().max()
    print(f"MEASURED qwen3_next_bf16_compiled_vs_plain_max_abs = {float(diff):.3g}")
    assert diff < 0.05
