"""Token dispatch without host reads, where one rank holds every routed expert.

megatron-core's allgather dispatcher reads the routing back to the host in every MoE layer: the
per-expert token counts (``.cpu()``) and two ``masked_select``s, whose output sizes depend on the
data. On a GPU each read stalls the host until the device has caught up, three times per MoE layer
and forward, so the host cannot queue the next layer's kernels ahead. With every expert on one
rank (expert-tensor and expert-parallel sizes 1, no capacity or padding) each token makes exactly
top-k assignments, so the permuted batch has a size known in advance: ``OneRankDispatch`` orders
the assignments with a stable sort, by expert and then by token, the order megatron-core's
permutation gives, and keeps the counts on the device, where ``GroupedExperts`` takes them as its
grouped GEMM's offsets (megatron-core's per-expert loop reads them itself).
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


class OneRankDispatch(MoEAllGatherTokenDispatcher):
    """The allgather dispatcher's permutation, without host reads (module docstring); its token
    gather and combine are the parent's, which on one rank communicate nothing."""

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape_before_permute = hidden_states.shape
        routing = self.local_map = self.routing_map  # [tokens, experts], every expert local
        n = routing.shape[0] * self.router_topk
        # assignments expert-major, tokens ascending within an expert: the stable sort puts them first
        order = routing.T.reshape(-1).to(torch.uint8).argsort(descending=True, stable=True)[:n]
        tokens = order % routing.shape[0]
        counts = routing.sum(dim=0)
        # a token that names one expert twice (a hash table can) makes fewer assignments: the rest
        # go to the last expert with probability 0, so they add nothing to any token
        counts[-1] += n - counts.sum()
        self.reversed_local_input_permutation_mapping = tokens
        self.local_probs = probs.T.reshape(-1).index_select(0, order)
        self.routing_map = None
        return hidden_states.index_select(0, tokens), counts, self.local_probs


# settings that drop or pad tokens, so that a token's assignments are not exactly top-k; read with
# a default, as megatron-core versions add and retire them
_RESHAPING = ("moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
              "moe_router_padding_for_quantization", "moe_router_padding_for_fp8")


def _one_rank(dispatcher: Any) -> bool:
    return (type(dispatcher) is MoEAllGatherTokenDispatcher and dispatcher.tp_size == 1
            and dispatcher.ep_size == 1 and not any(getattr(dispatcher.config, k, None) for k in _RESHAPING))


def dispatch_on_one_rank(model: torch.nn.Module) -> None:
    """Give every MoE layer of ``model`` whose allgather dispatcher runs on one rank
    ``OneRankDispatch``'s permutation; other dispatchers and parallel layouts keep megatron-core's."""
    for m in model.modules():
        if isinstance(m, MoELayer) and _one_rank(m.token_dispatcher):
            # the dispatcher megatron-core built, with this postprocess: the subclass adds no state
            m.token_dispatcher.__class__ = OneRankDispatch
