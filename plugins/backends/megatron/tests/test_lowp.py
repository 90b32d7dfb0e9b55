"""trainer.precision fp8 / mxfp8 and trainer.qat int4 in the megatron trainer on CPU (tests/cpu_shim.py):
its log-probs equal a Hugging Face forward with libs/lowp's same emulated rounding (the fsdp2
trainer's numerics), differ from full precision, and training lowers the loss."""
import pytest
import torch
from helpers import Spec, batch, hf_logprobs
from miles import MilesError
from miles_plugin_megatron.config import MegatronConfig


def make(family: str, **cfg):
    from miles_plugin_megatron.trainer import MegatronTrainer

    cfg = MegatronConfig(device="cpu", **{"lr": 1e-3, "grad_clip": None, **cfg})
    return MegatronTrainer(cfg, spec=Spec(family), tokenizer=None, seed=0, total_steps=10)


def sft(mb, lp):
    return -mb.token_mean(lp), {}


@pytest.mark.parametrize("family,over", [("llama", {"precision": "fp8"}), ("qwen3_moe", {"precision": "fp8"}),
                                         ("qwen2", {"precision": "mxfp8"}), ("qwen3_moe", {"qat": "int4"}),
                                         ("qwen3_moe", {"qat": "int4", "qat_scope": "experts"})])
def test_logprobs_equal_hf_with_lowp_rounding_and_training_lowers_loss(megatron_cpu, family, over):
    from miles_lowp.linear import convert

    over = {"precision": "fp32", **over}
    tr = make(family, **over)
    b = batch()
    named = dict(tr.named_weights())
    full = Spec(family).build_model(None).eval()
    full.load_state_dict(named)
    low = Spec(family).build_model(None).eval()
    low.load_state_dict(named)
    fmt = over.get("qat") or over["precision"]
    assert convert(low, over["precision"], over.get("qat"), over.get("qat_scope", "all")) == tr.packed_formats
    if over.get("qat_scope") == "experts":
        assert tr.packed_formats and all(".experts." in k for k in tr.packed_formats)
    got, want, plain = tr.logprobs(b), hf_logprobs(low, b), hf_logprobs(full, b)
    m = b.loss_mask
    assert ((got - want) * m).abs().max() < 2e-5
    assert ((got - plain) * m).abs().max() > 1e-3  # the rounding really runs
    # the served weights are the rounded ones: a plain HF model loading them computes the same
    served = Spec(family).build_model(None).eval()
    served.load_state_dict(dict(tr.served_weights(named.items())))
    if fmt == "int4":  # weight-only rounding: the plain forward is the QAT forward
        assert ((hf_logprobs(served, b) - got) * m).abs().max() < 2e-5
    losses = [tr.train_step(b, sft)["loss"] for _ in range(3)]
    assert losses[2] < losses[0] - 1e-3
    after = dict(tr.named_weights())
    low.load_state_dict(after)
    assert ((tr.logprobs(b) - hf_logprobs(low, b)) * m).abs().max() < 2e-5


def test_config_pairs_and_refusals(megatron_cpu):
    from miles.protocols import TrainsInPrecision
    from miles_lowp.pairs import pair_problem

    cfg = MegatronConfig(precision="fp8")
    assert isinstance(cfg, TrainsInPrecision)  # the engines check their weights_dtype against it
    assert pair_problem(cfg.precision, cfg.qat, "fp8") is None
    assert "not a supported pair" in pair_problem(cfg.precision, cfg.qat, "int4")
    assert pair_problem("bf16", MegatronConfig(qat="int4").qat, "int4") is None
    with pytest.raises(MilesError, match="trainer.qat"):
        make("llama", precision="fp8", qat="int4")
    with pytest.raises(MilesError, match="trainer.precision: mxfp8 .*multi-latent"):
        from types import SimpleNamespace

        from miles_plugin_megatron.lowp import check_arch
        check_arch(cfg.model_copy(update={"precision": "mxfp8"}),
                   SimpleNamespace(kv_lora_rank=512, attention_gate=False, linear_layers=(), shared_gate=False,
                                   glu_alpha=None, linear_bias=False, hf_attention=False))
    from miles_plugin_megatron.lowp import check_shards

    w = torch.zeros(64, 32)
    check_shards("trainer.precision", "fp8", "x", torch.zeros(128, 256), None, True, 2)  # aligned: fine
    check_shards("trainer.qat", "int4", "x", w, None, True, 2)  # INT4 groups run along the rows
    with pytest.raises(MilesError, match="trainer.precision.*tensor_parallel: 2"):
        check_shards("trainer.precision", "fp8", "x", w, None, True, 2)
    with pytest.raises(MilesError, match="trainer.qat"):
        check_shards("trainer.qat", "int4", "x", w, None, False, 2)
