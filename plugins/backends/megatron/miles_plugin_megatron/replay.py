"""Rollout routing replay (R3) in megatron-core MoE layers.

When the run's model spec records routing (``miles.protocols.RecordsRouting``), every sample
carries the experts the engine chose for each of its tokens: ``Sample.extensions[<spec's
extension>]["routed_experts"]``, int32 ``[prompt + response - 1, layers, top_k]``. The trainer's
MoE layers then use exactly those experts, prompt and response tokens alike (as the fsdp2 trainer
does through the spec), and route the rest (padding, the last response token, samples without a
record) as usual.

The hook is megatron-core's own: ``TopKRouter.router_replay``, an object whose
``get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)`` picks the experts
inside ``topk_routing_with_score_function``. The gate weights are the router's own scores gathered
at the replayed experts (softmax over them, or the pre-softmax probabilities), so gradients still
reach the router. The router class carrying it is put into the layer spec, as any model-spec edit
is; megatron-core itself is not patched.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from miles import Batch, MilesError
from miles_tokens import routed_experts_rows

from .arch import _submodules


class ReplayTable:
    """The experts the routers of one trainer's models replay now: ``[tokens, layers, top_k]``
    long in megatron-core's token order (sequence-major: ``s * B + b``), -1 where a token is
    routed as usual; None outside ``replaying``."""

    def __init__(self, layers: int, top_k: int, experts: int, extension: str,
                 moe_layers: list[int] | None = None):
        self.layers, self.top_k, self.experts, self.extension = layers, top_k, experts, extension
        # records hold the MoE layers only: decoder layer -> its column (dense first layers skipped)
        self.column = {layer: c for c, layer in enumerate(moe_layers if moe_layers is not None else range(layers))}
        self.mixed = max(self.column, default=-1) + 1 > layers
        self.table: torch.Tensor | None = None

    @contextlib.contextmanager
    def replaying(self, batch: Batch, width: int) -> Iterator[None]:
        """Forwards inside replay ``batch``'s records on its right-aligned rows (``width`` tokens
        each, row position ``j`` = the sample's token ``j``)."""
        rows = self.rows(batch, width)  # [B, S, layers, k]
        self.table = rows.transpose(0, 1).reshape(-1, self.layers, self.top_k).to(batch.input_ids.device)
        try:
            yield
        finally:
            self.table = None

    def rows(self, batch: Batch, width: int) -> torch.Tensor:
        """``[B, width, layers, top_k]`` recorded experts per row position, -1 where none."""
        try:
            return routed_experts_rows(batch.samples, self.extension, self.layers, self.top_k, width,
                                       experts=self.experts)
        except ValueError as e:
            raise MilesError(f"routing replay: {e}; were they recorded by another model? set "
                             f"model.routing_replay=false") from None


class _Replay:
    """megatron-core's ``router_replay`` slot of one router: the table's column of its layer."""

    def __init__(self, table: ReplayTable, layer: Callable[[], int | None]):
        self.table, self.layer = table, layer

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Callable | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        own = default_compute_topk(scores, topk, num_groups, group_topk)  # positional, as megatron-core calls it
        if self.table.table is None:
            return own
        number = self.layer()  # megatron-core numbers layers from 1, across pipeline stages
        forced = self.table.table[:, self.table.column[number - 1]].to(scores.device)
        if forced.shape[0] != scores.shape[0]:
            raise MilesError(f"routing replay: {forced.shape[0]} recorded tokens for a forward of "
                             f"{scores.shape[0]} tokens")
        index = torch.where(forced[:, :1] >= 0, forced, own[1])
        return scores.gather(1, index), index


def router_class(base: type, table: ReplayTable) -> type:
    """``base`` (a ``TopKRouter``) whose ``router_replay`` replays ``table``."""
    from megatron.core.transformer.moe.router import TopKRouter

    if not (isinstance(base, type) and issubclass(base, TopKRouter)):
        raise MilesError(f"routing replay: the layer spec's router {base!r} is not a megatron-core "
                         f"TopKRouter, so the recorded experts cannot be replayed in it")

    class ReplayRouter(base):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if not hasattr(self, "router_replay"):
                raise MilesError("routing replay needs megatron-core >= 0.16 (TopKRouter.router_replay)")
            self.router_replay = _Replay(table, lambda: self.layer_number)

    ReplayRouter.__name__ = ReplayRouter.__qualname__ = f"Replay{base.__name__}"
    return ReplayRouter


def spec_edit(table: ReplayTable) -> Callable[[Any], Any]:
    """A layer-spec edit that swaps the MoE router for one replaying ``table``."""
    def edit(spec: Any) -> Any:
        moe = _submodules(spec.submodules.mlp)
        if table.mixed and (moe is None or not hasattr(moe, "router")):
            return spec  # a dense layer of a model with MoE ones
        if moe is None or not hasattr(moe, "router"):
            raise MilesError("routing replay: the Megatron layer spec has no MoE router to replay into")
        moe.router = router_class(moe.router, table)
        return spec

    return edit


def table_for(spec: Any, hf_model: torch.nn.Module, arch: Any) -> ReplayTable | None:
    """The replay table of a trainer whose model spec records routing (None otherwise)."""
    from miles.protocols import RecordsRouting, RoutingRecorder

    if not isinstance(spec, RecordsRouting):
        return None
    if not arch.moe:
        raise MilesError(f"model spec {type(spec).__name__} records MoE routing, but the model "
                         f"({arch.family}) has no MoE layers")
    recorder = spec.routing_recorder(hf_model)
    extension = recorder.extension if isinstance(recorder, RoutingRecorder) else None
    if not isinstance(extension, str):
        raise MilesError(f"model spec {type(spec).__name__}: its routing recorder is no "
                         f"miles.protocols.RoutingRecorder naming its Sample.extensions key (`extension`)")
    moe_layers = [i for i in range(arch.num_layers) if arch.moe_layer(i)]
    return ReplayTable(len(moe_layers), arch.topk, arch.experts, extension, moe_layers)
