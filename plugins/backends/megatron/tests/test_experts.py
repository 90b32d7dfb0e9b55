"""Routed experts as grouped GEMMs (``miles_plugin_megatron.experts``): the same outputs and
gradients as megatron-core's per-expert loop, used by every MoE family's layers, and a training
step's kernels no longer grow with the expert count."""
from __future__ import annotations

import pytest
import torch
from frontier import Spec
from frontier_worker import step
from helpers import batch
from megatron.core.transformer.moe.experts import SequentialMLP

from miles.testing.syncs import OpCounter

from miles_plugin_megatron.config import MegatronConfig
from miles_plugin_megatron.experts import GroupedExperts
from miles_plugin_megatron.trainer import MegatronTrainer


MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm}


def trainer(family: str, **over) -> MegatronTrainer:
    cfg = MegatronConfig(device="cpu", precision="fp32", lr=1e-3, grad_clip=None)
    return MegatronTrainer(cfg, spec=Spec(family, **over), tokenizer=None, seed=0, total_steps=4)


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])  # gpt-oss: biased experts, clamped GLU
def test_grouped_experts_equal_the_per_expert_loop(megatron_cpu, family):
    tr = trainer(family)
    modules = [m for m in tr.model.modules() if isinstance(m, GroupedExperts)]
    assert modules, f"{family}: no MoE layer runs grouped experts"
    experts = modules[-1]
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1, 7, 2, 0, 4])[:experts.num_local_experts]
    x = torch.randn(int(counts.sum()), tr.model.config.hidden_size, generator=g, requires_grad=True)
    probs = torch.rand(x.shape[0], generator=g)
    weights = [p for p in experts.parameters()]
    outs, grads = [], []
    for forward in (GroupedExperts.forward, SequentialMLP.forward):
        for p in [x, *weights]:
            p.grad = None
        out, _ = forward(experts, x, counts, probs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in [x, *weights]])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_step_does_not_loop_over_experts(megatron_cpu, monkeypatch):
    """With 4x the experts, a training step runs the same matmuls: none per expert."""
    counts = []
    for experts in (8, 32):
        tr = trainer("deepseek_v3", n_routed_experts=experts)
        monkeypatch.setattr(SequentialMLP, "forward", lambda *a, **k: pytest.fail("the per-expert loop ran"))
        b = batch(rows=4)
        step(tr, b)
        with OpCounter(MATMULS) as c:
            step(tr, b)
        counts.append(c.n)
        monkeypatch.undo()
    assert counts[0] == counts[1], counts


def test_a_grouped_gemm_that_raises_falls_back_to_the_loop(megatron_cpu, monkeypatch, caplog):
    """A kernel the torch build or device lacks: the step still runs, through the loop, with the
    same log-probs, and says so once."""
    import miles_plugin_megatron.experts as experts

    tr = trainer("deepseek_v3")
    b = batch(rows=4)
    want = tr.logprobs(b)

    def missing(*args, **kwargs):
        raise RuntimeError("grouped_mm: no kernel for this device")

    monkeypatch.setattr(experts, "_GMM", missing)
    monkeypatch.setattr(GroupedExperts, "refused", None)
    with caplog.at_level("WARNING", logger="miles_plugin_megatron.experts"):
        got = tr.logprobs(b)
        step(tr, b)
    assert GroupedExperts.refused == "grouped_mm: no kernel for this device"
    assert sum("per-expert loop" in r.getMessage() for r in caplog.records) == 1
    mask = b.loss_mask.bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
