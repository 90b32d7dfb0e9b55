"""Routers that record or replay the experts each token is sent to.

Each mixture-of-experts router (the modules an architecture's ``RoutesExperts.routers`` lists, or
the built-in Qwen3-MoE / Mixtral ones) keeps its own module, parameters and forward; a forward
hook sees what it returned, ``(router_logits, top_k_weights, top_k_index)``. In ``record`` mode
the hook appends the chosen expert ids; in ``replay`` mode it swaps in the ids of ``state.replay``
``[tokens, moe_layers, top_k]`` (a row of -1 means: keep the router's own choice) and the weights
the architecture gives those experts from the router's own logits, so gradients still reach the
router. Checkpoints, weight sync, export and FSDP2 see the unchanged Hugging Face modules.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from miles.protocols import RoutesExperts
from miles_tokens.routing import softmax_topk_weights

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "MixtralTopKRouter")


class RoutingState:
    """What a model's routers do now: route, record their choices, or replay given experts."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int):
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.mode = "route"
        self.log: list[torch.Tensor] = []  # record mode: [tokens, top_k] per router call, in order
        self.replay: torch.Tensor | None = None

    @contextlib.contextmanager
    def replaying(self, experts: torch.Tensor) -> Iterator[None]:
        """Forwards inside use ``experts`` ``[tokens, layers, top_k]`` (flattened rows x positions)."""
        if experts.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(f"routed experts have shape {tuple(experts.shape)}; this model needs "
                             f"[tokens, {self.num_layers}, {self.top_k}]")
        self.mode, self.replay = "replay", experts.long()
        try:
            yield
        finally:
            self.mode, self.replay = "route", None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.mode, self.log = "record", []
        try:
            yield
        finally:
            self.mode = "route"

    def mark(self) -> int:
        return len(self.log)

    def split_off(self, mark: int) -> list[torch.Tensor]:
        entries, self.log = self.log[mark:], self.log[:mark]
        return entries

    def log_copies(self, entries: list[torch.Tensor]) -> None:
        """One copy of every entry (a single kernel: they are one forward's, of one shape)."""
        if entries:
            self.log.extend(torch.stack(entries).unbind(0))

    def take(self) -> list[torch.Tensor]:
        """Per recorded forward, ``[tokens, layers, top_k]`` int32 expert ids (CPU)."""
        log, self.log = self.log, []
        L = self.num_layers
        if len(log) % L:
            raise RuntimeError(f"routing log holds {len(log)} router calls, not a multiple of {L} layers")
        forwards = [torch.stack(log[i:i + L], dim=1) for i in range(0, len(log), L)]
        if not forwards:
            return []
        # one device-to-host copy for the whole call: each copy waits for the device
        return list(torch.cat(forwards).cpu().split([f.shape[0] for f in forwards]))


class RouterHook:
    """The forward hook of one router (layer ``layer`` of the shared ``state``)."""

    def __init__(self, rules: RoutesExperts, layer: int, state: RoutingState):
        self.rules, self.layer, self.state = rules, layer, state

    def __call__(self, router: torch.nn.Module, args: Any, output: Any) -> Any:
        logits, weights, index = output
        state = self.state
        if state.mode == "record":
            state.log.append(index.to(torch.int32))
        if state.mode != "replay":
            return None
        forced = state.replay[:, self.layer].to(index.device)
        if forced.shape[0] != index.shape[0]:
            raise ValueError(f"routing replay: {forced.shape[0]} recorded tokens for a forward of "
                             f"{index.shape[0]} tokens")
        given = forced[:, :1] >= 0  # tokens without a record keep the router's own choice and weights
        index = torch.where(given, forced, index)
        replayed = self.rules.gate_weights(router, logits, index)
        return logits, torch.where(given, replayed, weights), index


class BuiltinRouters:
    """Qwen3-MoE and Mixtral: softmax over the experts, then top-k (Qwen3-MoE renormalises when
    ``norm_topk_prob`` and casts back to the logits' dtype; Mixtral always renormalises)."""

    def routers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]

    def gate_weights(self, router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        qwen = type(router).__name__.startswith("Qwen3")
        return softmax_topk_weights(logits, indices, bool(router.norm_topk_prob) if qwen else True, cast=qwen)


def install(model: torch.nn.Module, rules: RoutesExperts | None = None) -> RoutingState:
    """Hook every MoE router of ``model`` (those ``rules`` lists; default: the built-in Qwen3-MoE
    and Mixtral routers) to one shared state."""
    rules = rules if rules is not None else BuiltinRouters()
    routers = rules.routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router that routing replay knows")
    state = RoutingState(len(routers), routers[0].top_k, routers[0].num_experts)
    for layer, router in enumerate(routers):
        router.register_forward_hook(RouterHook(rules, layer, state))
    return state


def find_state(model: torch.nn.Module) -> RoutingState | None:
    """The state ``install`` hooked ``model``'s routers to (a deep copy of a model has its own)."""
    for mod in model.modules():
        for hook in mod._forward_hooks.values():
            if isinstance(hook, RouterHook):
                return hook.state
    return None
