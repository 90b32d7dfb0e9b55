"""Pipeline parallelism of the megatron trainer: which weights a stage holds, megatron-core's
pipeline schedule (``get_forward_backward_func``: 1F1B, or interleaved 1F1B with virtual stages;
activations sent stage to stage), and the stage-to-stage broadcasts that give every rank the full
model a layer at a time.

Stage ``s`` of ``pp`` holds decoder layers ``[s * L / pp, (s + 1) * L / pp)`` under local indices
(megatron-core numbers a stage's layers from 0); the first stage the embedding, the last the final
norm and the output layer, which with tied embeddings is a copy of the embedding kept equal by
summing the two copies' gradients over megatron-core's embedding group. With ``vp`` virtual
stages per rank the layers are cut into ``pp * vp`` chunks and stage ``s`` runs chunks ``s``,
``s + pp``, ... (a :class:`Chunks` module), so a micro-batch passes every rank ``vp`` times.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_CHUNK = re.compile(r"^chunks\.(\d+)\.(.+)$")


class Chunks(torch.nn.Module):
    """The model chunks one pipeline rank runs with interleaved (virtual) stages: chunk ``c`` of
    stage ``s`` is virtual stage ``c * pp + s``. Its weights are named ``chunks.<c>.<GPTModel name>``."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    def sharded_state_dict(self, prefix: str = "", **kwargs: Any) -> dict[str, Any]:
        """The chunks' megatron-core sharded state dicts: keys under each chunk's module name, the
        sharded tensors under the global names megatron-core gives them (layer offsets included)."""
        out = {}
        for c, chunk in enumerate(self.chunks):
            for k, v in chunk.sharded_state_dict(prefix=prefix, **kwargs).items():
                out[f"{prefix}chunks.{c}.{k.removeprefix(prefix)}"] = v
        return out

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        first = self.chunks[0]
        return (first if first.pre_process else self.chunks[-1]).shared_embedding_or_output_weight()


def layers_of(num_layers: int, pp: int, stage: int, vp: int = 1, chunk: int = 0) -> range:
    """The global decoder layers of ``chunk`` of ``stage`` (virtual stage ``chunk * pp + stage``)."""
    per = num_layers // (pp * vp)
    start = (chunk * pp + stage) * per
    return range(start, start + per)


def _parts(num_layers: int, pp: int, stage: int, vp: int) -> list[tuple[str, range, bool, bool]]:
    """``(name prefix, global layers, holds the embedding, holds the final norm and output)`` of
    each model chunk of a stage."""
    if vp == 1:
        return [("", layers_of(num_layers, pp, stage), stage == 0, stage == pp - 1)]
    return [(f"chunks.{c}.", layers_of(num_layers, pp, stage, vp, c), stage == 0 and c == 0,
             stage == pp - 1 and c == vp - 1) for c in range(vp)]


def to_stage(tensors: dict[str, torch.Tensor], num_layers: int, pp: int, stage: int,
             tied: bool, vp: int = 1) -> dict[str, torch.Tensor]:
    """A rank's tensors under full-model names -> the ones its stage holds, under its names."""
    out = {}
    for prefix, layers, first, last in _parts(num_layers, pp, stage, vp):
        for name, t in tensors.items():
            hit = _LAYER.match(name)
            if hit is not None:
                if int(hit[1]) in layers:
                    out[f"{prefix}decoder.layers.{int(hit[1]) - layers.start}.{hit[2]}"] = t
            elif name.startswith("embedding."):
                if first:
                    out[prefix + name] = t
            elif last:
                out[prefix + name] = t
        if last and tied and not first:  # the last stage's copy of the tied embedding
            out[prefix + "output_layer.weight"] = tensors["embedding.word_embeddings.weight"]
    return out


def to_full_name(name: str, num_layers: int, pp: int, stage: int, vp: int = 1) -> str:
    chunk = 0
    if vp > 1:
        hit = _CHUNK.match(name)
        chunk, name = int(hit[1]), hit[2]
    hit = _LAYER.match(name)
    if hit is None:
        return name
    return f"decoder.layers.{int(hit[1]) + layers_of(num_layers, pp, stage, vp, chunk).start}.{hit[2]}"


def unchunked(name: str) -> str:
    """A weight's name in its chunk (``chunks.<c>.`` removed)."""
    hit = _CHUNK.match(name)
    return name if hit is None else hit[2]


def last_prefix(vp: int) -> str:
    """The name prefix of the chunk holding the final norm and output layer (on the last stage)."""
    return "" if vp == 1 else f"chunks.{vp - 1}."


def across_stages(mine: Iterator[dict[str, torch.Tensor]], stage: int, pp: int,
                  device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Every stage's groups of full tensors, in stage order, on every rank: a stage yields its
    own (``mine``) and broadcasts each over the pipeline group; the others receive it."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    for s in range(pp):
        src = dist.get_global_rank(group, s)
        if s == stage:
            for full in mine:
                box = [[(k, tuple(v.shape), v.dtype) for k, v in full.items()]]
                dist.broadcast_object_list(box, src=src, group=group)
                for v in full.values():
                    dist.broadcast(v.contiguous(), src=src, group=group)
                yield full
            dist.broadcast_object_list([None], src=src, group=group)  # end of this stage's groups
            continue
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=src, group=group)
            if box[0] is None:
                break
            full = {k: torch.empty(shape, dtype=dtype, device=device) for k, shape, dtype in box[0]}
            for v in full.values():
                dist.broadcast(v, src=src, group=group)
            yield full


def run(model: torch.nn.Module, plan: list, forward: Callable, loss_of: Callable, *,
        forward_only: bool) -> list[Any]:
    """megatron-core's pipeline schedule over the micro-batches of ``plan`` (``(run, real)`` pairs of
    equal shape). ``forward(model, run)`` -> the stage's output; on the last stage
    ``loss_of(run, real, output)`` -> ``(loss, data)``. Returns the last stage's ``data`` list
    (empty elsewhere). The loss given back to the schedule is multiplied by the micro-batch count,
    which the schedule divides by: ``loss`` already is its micro-batch's share of the whole."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(plan)

    def step(it: Iterator, m: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        run_, real = next(it)
        return forward(m, run_), partial(_scaled, loss_of, run_, real, n)

    first = plan[0][0]
    models = list(model.chunks) if isinstance(model, Chunks) else [model]
    # interleaved stages: every chunk runs every micro-batch, in order, from its own iterator
    data = [iter(plan) for _ in models] if len(models) > 1 else iter(plan)
    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=data, model=models, num_microbatches=n,
        seq_length=first.input_ids.shape[1], micro_batch_size=len(first), forward_only=forward_only)


def _scaled(loss_of: Callable, run_: Any, real: Any, n: int, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
    loss, data = loss_of(run_, real, output)
    return loss * n, data


def from_last_stage(obj: Any) -> Any:
    """A Python object of the last pipeline stage, on every stage of this pipeline."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return box[0]


def tensor_from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """A tensor of the last pipeline stage (``t``: its shape and dtype elsewhere), on every stage."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    t = t.contiguous()
    dist.broadcast(t, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return t


def sum_tied_grads(model: torch.nn.Module) -> None:
    """The tied embedding's two copies (first and last stage) get the sum of their gradients."""
    from megatron.core import parallel_state as ps

    if not ps.is_rank_in_embedding_group(ignore_virtual=True):
        return
    w = model.shared_embedding_or_output_weight()
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    dist.all_reduce(w.grad, group=ps.get_embedding_group())
