"""Token dispatch on one rank (``miles_plugin_megatron.dispatch``): the same permutation, outputs and
gradients as megatron-core's allgather dispatcher, without its host reads."""
from __future__ import annotations

import torch
from frontier import Spec
from frontier_worker import step
from helpers import batch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from miles.testing.syncs import count_syncs

from miles_plugin_megatron.config import MegatronConfig
from miles_plugin_megatron.dispatch import OneRankDispatch
from miles_plugin_megatron.trainer import MegatronTrainer


def trainer(family: str = "deepseek_v3") -> MegatronTrainer:
    cfg = MegatronConfig(device="cpu", precision="fp32", lr=1e-3, grad_clip=None)
    return MegatronTrainer(cfg, spec=Spec(family), tokenizer=None, seed=0, total_steps=4)


def dispatchers(model: torch.nn.Module) -> list:
    return [m.token_dispatcher for m in model.modules() if isinstance(m, MoELayer)]


def moe(layer: MoELayer, kind: type, hidden: torch.Tensor, probs: torch.Tensor, routing: torch.Tensor):
    """The layer's routed experts on ``routing`` (``[tokens, experts]``) through ``kind``'s dispatch."""
    d = layer.token_dispatcher
    d.__class__ = kind
    h, p = d.token_dispatch(*d.dispatch_preprocess(hidden, routing, probs))
    x, counts, p = d.dispatch_postprocess(h, p)
    out, _ = layer.experts(x, counts, p)
    return d.combine_postprocess(d.token_combine(d.combine_preprocess(out)))


def test_every_moe_layer_dispatches_on_one_rank_and_reads_nothing_back(megatron_cpu):
    tr = trainer()
    assert dispatchers(tr.model) and all(type(d) is OneRankDispatch for d in dispatchers(tr.model))
    b = batch(rows=4)
    step(tr, b)

    def dispatch_reads() -> int:
        with count_syncs() as s:
            step(tr, b)
        return sum(n for site, n in s.by_site().items() if "token_dispatcher" in site or "moe_utils" in site)

    assert dispatch_reads() == 0
    for d in dispatchers(tr.model):
        d.__class__ = MoEAllGatherTokenDispatcher
    assert dispatch_reads() >= 3 * len(dispatchers(tr.model))  # megatron-core's: counts and two selects


def test_outputs_and_gradients_equal_megatron_cores_dispatch(megatron_cpu):
    """Top-k routing, and a token that names one expert twice (a hash table can): fewer assignments
    than top-k, the rest of the fixed-size batch contributing nothing."""
    tr = trainer()
    layer = next(m for m in tr.model.modules() if isinstance(m, MoELayer))
    tokens, experts, k = 12, layer.config.num_moe_experts, layer.config.moe_router_topk
    g = torch.Generator().manual_seed(0)
    chosen = torch.rand(tokens, experts, generator=g).topk(k, dim=-1).indices
    chosen[3, 1] = chosen[3, 0]  # token 3: one expert twice
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)
    probs = torch.zeros(tokens, experts).scatter(1, chosen, torch.rand(tokens, k, generator=g))
    hidden = torch.randn(tokens, 1, layer.config.hidden_size, generator=g)
    results = []
    for kind in (OneRankDispatch, MoEAllGatherTokenDispatcher):
        h, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
        out = moe(layer, kind, h, p, routing)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), h.grad, p.grad * routing))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
