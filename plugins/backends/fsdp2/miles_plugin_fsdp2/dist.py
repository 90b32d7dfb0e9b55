"""Process group, FSDP2 sharding and the collectives of the fsdp2 trainer.

SPMD, torchrun-style: every rank is its own process and sees the same global batch; a rank's
share is decided from that batch alone, so ranks agree on it without talking.
"""
from __future__ import annotations

import atexit
import itertools
import math
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from miles import MilesError
import miles_wire as W
from miles_wire import object_group  # a gloo group for objects and barriers, shared with megatron

# torch 2.13 renames all_gather_into_tensor (deprecated there, with a warning on every call)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def world_from_env(configured: int | None) -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from an initialised group or the launcher's env."""
    if dist.is_available() and dist.is_initialized():
        world, rank, source = dist.get_world_size(), dist.get_rank(), "the initialised process group"
    else:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        source = "env WORLD_SIZE" if "WORLD_SIZE" in os.environ else "the default (no WORLD_SIZE set)"
    if configured is not None and configured != world:
        raise MilesError(f"trainer.world_size={configured} but {source} says {world} rank(s); set "
                         f"trainer.world_size=null to follow the launcher, or launch {configured} "
                         f"ranks (e.g. torchrun --nproc-per-node {configured} or launcher.trainer_ranks)")
    return rank, int(os.environ.get("LOCAL_RANK", rank)), world


def init_group(device: torch.device, world: int) -> None:
    """Join (or create) the default process group: NCCL on CUDA, gloo on CPU. Idempotent."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw: dict[str, Any] = {}
    if device.type == "cuda":  # NCCL binds to one GPU, named with its index
        kw["device_id"] = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if world == 1 and "MASTER_ADDR" not in os.environ:
        # a one-rank group (sharding asked for at world size 1) needs no rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    else:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise MilesError(f"the fsdp2 trainer runs {world} ranks but env {', '.join(missing)} is "
                             f"not set; start every rank with torchrun or the local launcher")
        dist.init_process_group(backend, **kw)
    atexit.register(destroy_groups)


def destroy_groups() -> None:
    """Destroy the process groups while the interpreter is whole. Once a model is sharded this
    only unregisters them: FSDP2's DTensors keep the gloo group, and its worker threads, alive
    until the process ends. A worker that releases the last collective's tensors during
    interpreter teardown takes the GIL and aborts the process ("terminate called without an
    active exception"); launcher-started ranks therefore leave before teardown
    (``miles.cli._leave_launched_rank``)."""
    W.drop_object_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, found generically: HF's ``_no_split_modules`` classes and their
    subclasses (a checkpoint's MTP layers, ``miles_mtp``: run outside the model's forward, they
    need hooks of their own to gather their weights, as does an MTP module around its layers), else
    any module whose class name ends with DecoderLayer (works through peft wrappers too)."""
    from miles_mtp import mtp_layers

    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if m is not model and any(c.__name__ in names for c in type(m).__mro__)]
    found = found or [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    # an MTP module holding its decoder layers (Qwen3-Next's ``mtp``): a unit around theirs, sharded after them
    return found + [m for m in mtp_layers(model) if m not in found]


def shard(model: torch.nn.Module, device: torch.device, mixed_precision: str | None) -> None:
    """``fully_shard`` each block, then the root (embeddings, final norm, LM head), in place.

    Gradients are SUMMED across ranks (divide factor 1): each rank's loss already is its share of
    the global mean (``Batch.global_tokens``), so the sum is the one-rank gradient.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy()
    if device.type == "cuda" and mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # older torch only has the deprecated name
            (getattr(m, "set_gradient_divide_factor", None) or m.set_reduce_scatter_divide_factor)(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                # a plain SUM: gloo has no PREMUL_SUM, the op FSDP picks for a custom factor
                m.set_force_sum_reduction_for_comms(True)


def rank_slices(runs: Sequence[int], world: int) -> list[range]:
    """Contiguous, balanced row ranges, one per rank, for rows in ``runs`` (lengths of the runs
    of consecutive rows that share a prompt).

    A cut moves to the nearest run boundary when that shifts it by at most a quarter of a rank's
    share, so a run (a rollout group) stays on one rank and shares its KV cache; otherwise the
    run is split and both ranks run its prompt. Ranks past the end of a batch smaller than the
    world get empty ranges.
    """
    B = sum(runs)
    starts = list(itertools.accumulate(runs))[:-1]
    slack = B // (4 * world)
    cuts = [0]
    for k in range(1, world):
        ideal = (2 * k * B + world) // (2 * world)  # k * B / world, halves rounded up
        near = [b for b in starts if abs(b - ideal) <= slack and b > cuts[-1]]
        cuts.append(max(cuts[-1], min(near, key=lambda b: (abs(b - ideal), b)) if near else ideal))
    cuts.append(B)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def gather_rows(local: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``[counts[r], ...]`` rows in rank order, on every rank."""
    m = max(max(counts), 1)
    padded = local.new_zeros((m, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def sum_metrics(local: dict[str, float]) -> dict[str, float]:
    """Per key, the sum over ranks (a rank that lacks a key adds 0); identical on every rank."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, local, group=object_group())
    out: dict[str, float] = {}
    for d in every:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


GATHER_BYTES = 256 << 20  # full-tensor bytes gathered per collective (bounds the extra memory)


def full_tensors(named: Any, limit: int = GATHER_BYTES) -> Any:
    """``(name, full tensor)`` for a state dict's ``(name, tensor)`` pairs, in order, on every
    rank: consecutive row-sharded DTensors of one dtype are gathered together, one
    all-gather per ``limit`` bytes, instead of one collective per tensor (a
    transformer block's 9 tensors in one go). Plain tensors pass through; other placements fall
    back to ``full_tensor()``."""
    from torch.distributed.tensor import DTensor, Shard

    group: list[tuple[str, Any]] = []
    size = 0
    for name, t in named:
        batchable = isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),) and t.dim() > 0
        if group and (not batchable or t.dtype != group[0][1].dtype or size + W.nbytes(t) > limit):
            yield from _gather_rows(group)
            group, size = [], 0
        if batchable:
            group.append((name, t))
            size += W.nbytes(t)
        else:
            yield name, t.full_tensor() if isinstance(t, DTensor) else t
    yield from _gather_rows(group)


def _gather_rows(group: list[tuple[str, Any]]) -> Any:
    """Full tensors of row-sharded DTensors (``torch.chunk`` layout: rank r holds rows
    ``[r*c, (r+1)*c)`` of ``c = ceil(rows / world)``, fewer or none at the end) in one collective:
    each rank's shards, padded to ``c`` rows, travel in one flat buffer; one ``cat`` packs it and
    one ``split_with_sizes_copy`` unpacks every tensor (no per-tensor copies: a sync's gather is
    otherwise host-bound, ~0.1 ms per tensor)."""
    if not group:
        return
    pg = group[0][1].device_mesh.get_group()
    world = dist.get_world_size(pg)
    plan, sizes = [], []
    for name, t in group:
        rows, rest = t.shape[0], tuple(t.shape[1:])
        chunk = -(-rows // world)
        plan.append((name, rows, rest, chunk))
        sizes.append(chunk * math.prod(rest))
    locals_ = [_local(t).reshape(-1) for _, t in group]
    like = locals_[0]
    if all(mine.numel() == n for mine, n in zip(locals_, sizes)):  # no padding: one copy
        send = torch.cat(locals_)
    else:
        send = torch.zeros(sum(sizes), dtype=like.dtype, device=like.device)
        torch._foreach_copy_([s[:m.numel()] for s, m in zip(send.split(sizes), locals_)], locals_)
    out = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
    ALL_GATHER(out, send, group=pg)
    fulls = [torch.empty((world * chunk, *rest), dtype=send.dtype, device=send.device)
             for _, _, rest, chunk in plan]
    torch.split_with_sizes_copy(out.view(world, -1), sizes, dim=1,
                                out=[f.view(world, n) for f, n in zip(fulls, sizes)])
    del out, send
    for (name, rows, _, _), full in zip(plan, fulls):
        yield name, full[:rows]


def _local(t: Any) -> torch.Tensor:
    """A DTensor's local shard (the attribute: ``to_local()`` is an autograd op, ~10 us a call)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()
