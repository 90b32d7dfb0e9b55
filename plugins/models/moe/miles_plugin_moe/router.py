"""Routers that record or replay the experts each token is sent to.

Each mixture-of-experts block's router module (``mlp.gate`` in Qwen3-MoE, ``mlp.gate`` /
``block_sparse_moe.gate`` in Mixtral) is replaced by a :class:`ReplayRouter` that owns the same
``weight`` parameter under the same name (checkpoints, weight sync and export are unchanged) and
returns what the original returns: ``(router_logits, top_k_weights, top_k_index)``.

One :class:`RoutingState` is shared by a model's routers. In ``record`` mode every router
appends its chosen expert ids; in ``replay`` mode the ids come from ``state.replay``
``[tokens, moe_layers, top_k]`` (a row of -1 means: route that token as usual), and the gate
weights are the softmax of the router's own logits at those experts, so gradients still reach
the router.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

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

    def take(self) -> list[torch.Tensor]:
        """Per recorded forward, ``[tokens, layers, top_k]`` int32 expert ids (CPU)."""
        log, self.log = self.log, []
        L = self.num_layers
        if len(log) % L:
            raise RuntimeError(f"routing log holds {len(log)} router calls, not a multiple of {L} layers")
        return [torch.stack(log[i:i + L], dim=1).cpu() for i in range(0, len(log), L)]


class ReplayRouter(torch.nn.Module):
    """A top-k softmax router (Qwen3-MoE / Mixtral semantics) that can record or replay."""

    def __init__(self, gate: torch.nn.Module, layer: int, state: RoutingState, normalize: bool,
                 cast_weights: bool):
        super().__init__()
        self.weight = gate.weight  # the same Parameter: names and optimizer state are unchanged
        self.top_k, self.num_experts, self.hidden_dim = gate.top_k, gate.num_experts, gate.hidden_dim
        self.layer, self.normalize, self.cast_weights = layer, normalize, cast_weights
        self._state = [state]  # in a list: a plain attribute would register nothing, but stays out of repr

    @property
    def state(self) -> RoutingState:
        return self._state[0]

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        state = self.state
        if state.mode == "replay":
            forced = state.replay[:, self.layer].to(probs.device)
            if forced.shape[0] != probs.shape[0]:
                raise ValueError(f"routing replay: {forced.shape[0]} recorded tokens for a forward of "
                                 f"{probs.shape[0]} tokens")
            own = probs.topk(self.top_k, dim=-1).indices
            index = torch.where(forced[:, :1] >= 0, forced, own)
        else:
            index = probs.topk(self.top_k, dim=-1).indices
            if state.mode == "record":
                state.log.append(index.to(torch.int32))
        weights = probs.gather(-1, index)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.cast_weights:
            weights = weights.to(logits.dtype)
        return logits, weights, index


def install(model: torch.nn.Module) -> RoutingState:
    """Replace every MoE router of ``model`` by a :class:`ReplayRouter` sharing one state."""
    gates = [(name, mod) for name, mod in model.named_modules() if type(mod).__name__ in ROUTER_CLASSES]
    if not gates:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router "
                         f"(supported: {', '.join(ROUTER_CLASSES)}); use model_type qwen3_moe or mixtral")
    first = gates[0][1]
    state = RoutingState(len(gates), first.top_k, first.num_experts)
    for layer, (name, gate) in enumerate(gates):
        qwen = type(gate).__name__.startswith("Qwen3")
        normalize = bool(gate.norm_topk_prob) if qwen else True  # Mixtral always renormalises
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, ReplayRouter(gate, layer, state, normalize, cast_weights=qwen))
    return state
