"""Routers in megatron-core's MoE layers for what its own routing does not compute.

DeepSeek-V4's: sqrt-softplus scores with a selection-only expert bias, and, in the layers
``Arch.hash_layers`` names, hash routing (a fixed token-id -> experts table, ``tid2eid``, picks the
experts; the learned scores still weigh them). megatron-core 0.16's
``topk_routing_with_score_function`` knows softmax and sigmoid only, so the router here is a
``TopKRouter`` subclass with its own ``routing``: transformers' ``DeepseekV4TopKRouter`` /
``DeepseekV4HashRouter`` arithmetic, returning megatron-core's ``(probs, routing_map)``. A hash
router needs the token ids of the forward: ``share_token_ids`` hands the model's ``input_ids`` to
its routers before each forward.

DeepSeek-V3's / GLM-4.5's sigmoid routing where megatron-core's group-limited top-k ranks the groups
otherwise (``grouped_sigmoid_router``). Replay (R3) in both goes through the same
``router_replay.get_replay_topk`` slot megatron-core's routing uses.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from .arch import Arch, fp32_router


@functools.cache  # one class per architecture: models built apart (policy, reference) share it
def router_class(arch: Arch) -> type:
    """The router of ``arch``'s MoE layers (``score == "sqrtsoftplus"``)."""
    hashed, vocab = frozenset(arch.hash_layers), arch.vocab

    class SqrtSoftplusRouter(fp32_router()):
        token_ids: torch.Tensor | None = None  # [B, S] of the running forward (share_token_ids)

        def set_layer_number(self, layer_number: int) -> None:
            super().set_layer_number(layer_number)
            if layer_number - 1 in hashed and not hasattr(self, "tid2eid"):
                # a hash layer: the table picks the experts, no bias takes part (nor is stored)
                self.register_buffer("tid2eid", torch.zeros(vocab, self.topk, dtype=torch.long,
                                                            device=self.weight.device))
                self.expert_bias = None

        def routing(self, logits: torch.Tensor, padding_mask: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
            logits = logits.view(-1, self.config.num_moe_experts)
            scores = F.softplus(logits.float()).sqrt()
            if hasattr(self, "tid2eid"):
                if self.token_ids is None:
                    from miles import MilesError

                    raise MilesError("trainer megatron: a hash-routed MoE layer ran without the forward's token ids")
                fixed = self.tid2eid[self.token_ids.transpose(0, 1).reshape(-1)]  # sequence-major, as the tokens

                def pick(s: torch.Tensor, k: int, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
                    return s.gather(1, fixed), fixed

                select = scores
            else:
                def pick(s: torch.Tensor, k: int, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
                    return torch.topk(s, k, dim=1)

                select = scores if self.expert_bias is None else scores + self.expert_bias
            if self.router_replay is not None:
                index = self.router_replay.get_replay_topk(select, self.topk, None, None, pick)[1]
            else:
                index = pick(select, self.topk)[1]
            weights = scores.gather(1, index)
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            if self.config.moe_router_topk_scaling_factor:
                weights = weights * self.config.moe_router_topk_scaling_factor
            probs = torch.zeros_like(logits).scatter(1, index, weights.to(logits.dtype))
            routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
            return probs, routing_map

    return SqrtSoftplusRouter


@functools.cache  # one class per process: models built apart (policy, reference) share it
def grouped_sigmoid_router() -> type:
    """Sigmoid routing with a selection-only expert bias and group-limited top-k whose groups are
    ranked by their two best experts' biased scores, as transformers' DeepSeek-V3 / GLM-4.5 routers
    rank them. megatron-core ranks a group by its top ``topk / group_topk`` scores, the same only
    where ``topk == 2 * group_topk``; this router serves the other configurations (e.g. top-2 of 4
    groups of which 2 are chosen)."""

    class GroupedSigmoidRouter(fp32_router()):
        def routing(self, logits: torch.Tensor, padding_mask: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
            cfg = self.config
            logits = logits.view(-1, cfg.num_moe_experts)
            scores = torch.sigmoid(logits.float()).type_as(logits)
            select = scores if self.expert_bias is None else scores + self.expert_bias

            def pick(s: torch.Tensor, k: int, groups: int, group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
                n = s.shape[0]
                ranked = s.view(n, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
                chosen = torch.zeros_like(ranked).scatter(1, torch.topk(ranked, group_topk, dim=-1, sorted=False)[1], 1)
                mask = chosen.unsqueeze(-1).expand(n, groups, s.shape[1] // groups).reshape(n, -1).bool()
                return torch.topk(s.masked_fill(~mask, float("-inf")), k, dim=-1)

            args = (select, self.topk, cfg.moe_router_num_groups, cfg.moe_router_group_topk)
            if self.router_replay is not None:
                index = self.router_replay.get_replay_topk(*args, pick)[1]
            else:
                index = pick(*args)[1]
            weights = scores.gather(1, index)
            if self.topk > 1:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            if cfg.moe_router_topk_scaling_factor:
                weights = weights * cfg.moe_router_topk_scaling_factor
            probs = torch.zeros_like(logits).scatter(1, index, weights)
            routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
            # the expert bias's token counts, as megatron-core's own routing keeps them
            padding = None if padding_mask is None else padding_mask.reshape(-1)
            self._apply_expert_bias(routing_map, padding_mask=padding)
            return probs, routing_map

    return GroupedSigmoidRouter


def share_token_ids(model: torch.nn.Module) -> None:
    """Before each forward of ``model`` (a ``GPTModel``: ``input_ids`` first), give its hash
    routers the token ids."""
    routers = [m for m in model.modules() if hasattr(m, "tid2eid")]
    if not routers:
        return

    def hand_over(_module: Any, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else kwargs.get("input_ids")
        for r in routers:
            r.token_ids = ids

    model.register_forward_pre_hook(hand_over, with_kwargs=True)
