"""Process groups of the megatron trainer: the world (torchrun-style env), megatron-core's
tensor / data / expert groups on top of it, and the few collectives the trainer needs."""
from __future__ import annotations

import atexit
import os
from typing import Any

import torch
import torch.distributed as dist
from miles import MilesError
from miles_wire import drop_object_groups, object_group

from .arch import Arch
from .config import MegatronConfig


def world_from_env(configured: int | None) -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from an initialised group or the launcher's env."""
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if configured is not None and configured != world:
        raise MilesError(f"trainer.world_size={configured} but the launcher started {world} rank(s); "
                         f"set trainer.world_size=null to follow the launcher, or launch {configured}")
    return rank, int(os.environ.get("LOCAL_RANK", rank)), world


def check_layout(cfg: MegatronConfig, arch: Arch, world: int) -> None:
    """Every parallel-size problem at once, each naming its key."""
    tp, pp, ep, vp = cfg.tensor_parallel, cfg.pipeline_parallel, cfg.expert_parallel, cfg.virtual_pipeline_parallel
    bad = []
    if vp > 1 and pp < 2:
        bad.append(f"trainer.virtual_pipeline_parallel={vp} interleaves pipeline stages: it needs "
                   f"trainer.pipeline_parallel >= 2 (or set it to 1)")
    elif vp > 1 and arch.num_layers % (pp * vp):
        bad.append(f"trainer.pipeline_parallel * trainer.virtual_pipeline_parallel = {pp} * {vp} does not "
                   f"divide the model's {arch.num_layers} layers (each virtual stage holds as many)")
    if world % (tp * pp):
        bad.append(f"world size {world} is not divisible by trainer.tensor_parallel * "
                   f"trainer.pipeline_parallel = {tp} * {pp}")
    if arch.num_layers % pp:
        bad.append(f"trainer.pipeline_parallel={pp} does not divide the model's {arch.num_layers} layers")
    split = [(arch.heads, "attention heads")]  # sizes TP ranks divide
    if arch.hf_attention:  # DeepSeek-V4: one KV head shared by all (whole on each rank), heads in whole groups
        split.append((arch.out_groups, "output groups (o_groups)"))
    else:
        split.append((arch.kv_heads, "KV heads (num_key_value_heads)"))
    if not all(arch.moe_layer(i) for i in range(arch.num_layers)):
        split.append((arch.ffn, "intermediate_size"))
    if arch.linear_layers:
        split += [(arch.linear_key_heads, "linear_num_key_heads"), (arch.linear_value_heads, "linear_num_value_heads")]
    for n, what in split:
        if n % tp:
            bad.append(f"trainer.tensor_parallel={tp} does not divide the model's {n} {what}")
    if ep > 1 and not arch.moe:
        bad.append(f"trainer.expert_parallel={ep} needs an MoE model; this one is dense: set it to 1")
    if arch.moe and arch.experts % ep:
        bad.append(f"trainer.expert_parallel={ep} does not divide the model's {arch.experts} experts")
    if arch.moe and arch.moe_ffn % arch.expert_tp(tp):
        bad.append(f"trainer.tensor_parallel={tp} does not divide moe_intermediate_size {arch.moe_ffn}")
    if world % (tp * ep * pp):
        bad.append(f"world size {world} is not divisible by trainer.tensor_parallel * "
                   f"trainer.expert_parallel * trainer.pipeline_parallel = {tp * ep * pp}")
    if arch.hc_mult > 1 and pp > 1:
        bad.append(f"trainer.pipeline_parallel={pp}: the model's {arch.hc_mult} hyper-connection residual streams "
                   f"(model.config.hc_mult) are not sent between pipeline stages; set trainer.pipeline_parallel=1")
    if bad:
        raise MilesError("trainer (megatron): " + "; ".join(bad))


def pick_device(name: str, local_rank: int, world: int) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MilesError(f"trainer.device={name}: torch sees no CUDA GPU here, and megatron-core's "
                         f"forward needs one; run on a GPU machine or use trainer.name=fsdp2 on CPU")
    if dev.type == "cuda" and dev.index is None and world > 1:
        dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev if dev.index is not None else torch.device("cuda", 0))
    return dev


def init(device: torch.device, world: int, tp: int, pp: int, ep: int, vp: int = 1, etp: int | None = None) -> None:
    """The default group (NCCL on CUDA, gloo on CPU), then megatron-core's parallel state,
    rebuilt when a trainer with other sizes was made in this process before. ``etp``: the experts'
    tensor-parallel size (default ``tp``; ``Arch.expert_tp``)."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise MilesError(f"the megatron trainer runs {world} ranks but env {', '.join(missing)} "
                                 f"is not set; start every rank with torchrun or the local launcher")
            dist.init_process_group(backend)
        atexit.register(destroy)
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size() or 1) == (tp, pp, ep, etp or tp, vp):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp)
    object_group()


def destroy() -> None:
    from megatron.core import parallel_state as ps

    drop_object_groups()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def gather_rows(local: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
    """Concatenate every group member's rows (``counts[i]`` rows from member i)."""
    if len(counts) == 1:
        return local
    most = max(counts)
    pad = torch.cat([local, local.new_zeros(most - local.shape[0], *local.shape[1:])])
    out = [torch.empty_like(pad) for _ in counts]
    dist.all_gather(out, pad.contiguous(), group=group)
    return torch.cat([o[:n] for o, n in zip(out, counts)])


def all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every group member's ``t`` (same shape on all), in rank order."""
    size = dist.get_world_size(group)
    if size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def all_reduce_grads(params: list[torch.nn.Parameter], group: Any) -> None:
    """Sum gradients over ``group``, flattened per dtype (one collective per dtype)."""
    if dist.get_world_size(group) == 1:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if not p.requires_grad:  # frozen (e.g. GLM-5's indexer): a zero gradient would let weight decay move it
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for g, x in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(x)
