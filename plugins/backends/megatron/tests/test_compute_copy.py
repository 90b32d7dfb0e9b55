"""The policy's compute copy (``compute.py``, bf16 on CUDA) on CPU in fp32: the same arithmetic as
the plain trainer, so every number must match it bit for bit; what could break is the plumbing
(gradients moved into the fp32 policy, the copy refreshed after steps and loads)."""
import pytest
import torch
from helpers import Spec, batch
from miles_plugin_megatron.config import MegatronConfig
from miles_telemetry import untimed


def make(copy: bool, monkeypatch, family: str = "qwen3_moe", seed: int = 0, **cfg):
    from miles_plugin_megatron import trainer

    monkeypatch.setattr(trainer, "compute_dtype", lambda *a: torch.float32 if copy else None)
    cfg = MegatronConfig(device="cpu", precision="fp32", **{"lr": 1e-3, **cfg})
    return trainer.MegatronTrainer(cfg, spec=Spec(family), tokenizer=None, seed=seed, total_steps=10)


def loss_fn(mb, lp):
    return -mb.token_mean(lp * mb.advantages), {"lp_mean": lp.detach().mean()}


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_training_through_the_copy_equals_plain_training(megatron_cpu, monkeypatch, family):
    plain, copied = make(False, monkeypatch, family, micro_batch_size=2), make(True, monkeypatch, family,
                                                                               micro_batch_size=2)
    assert plain.compute is None and copied.compute is not None
    b = batch(rows=5)  # three micro-batches: the fp32 sums of the copy's gradients
    plain.snapshot_reference()
    copied.snapshot_reference()
    for _ in range(3):
        assert untimed(plain.train_step(b, loss_fn)) == untimed(copied.train_step(b, loss_fn))
        # after a step the copy holds no gradient: each was moved into the fp32 policy
        assert all(p.grad is None for p in copied.compute.copy.parameters())
    assert torch.equal(plain.logprobs(b), copied.logprobs(b))  # the copy follows the steps
    assert torch.equal(plain.logprobs(b, "ref"), copied.logprobs(b, "ref"))
    for (k, v), (k2, v2) in zip(plain.named_weights(), copied.named_weights()):
        assert k == k2 and torch.equal(v, v2), k


def test_loads_refresh_the_copy(megatron_cpu, monkeypatch, tmp_path):
    src = make(True, monkeypatch, "qwen2")
    b = batch()
    src.train_step(b, loss_fn)
    want = src.logprobs(b)
    src.save(str(tmp_path / "ck"))
    weights = {k: v.clone() for k, v in src.named_weights()}

    other = make(True, monkeypatch, "qwen2", seed=5)
    stale = other.logprobs(b)  # the copy is built and in use before the load
    assert not torch.equal(stale, want)
    other.load_weights(weights.items())
    assert torch.equal(other.logprobs(b), want)

    resumed = make(True, monkeypatch, "qwen2", seed=6)
    resumed.logprobs(b)
    resumed.load(str(tmp_path / "ck"))
    assert torch.equal(resumed.logprobs(b), want)
    assert untimed(src.train_step(b, loss_fn)) == untimed(resumed.train_step(b, loss_fn))
