"""Trainer checkpoints through megatron-core's distributed checkpointing (``dist_checkpointing``,
torch_dist format).

Each rank contributes its shards of the policy, the AdamW moments, the reference model and the
critic and the draft head or trained MTP layer (each with its optimizer) as megatron-core sharded
state dicts: global tensors described by offsets, replicas written once, TP-split ``[gate; up]``
weights re-assembled by megatron-core's own factories. On load each rank reads the parts its layout
holds, so a checkpoint written at one tensor- / expert- / data-parallel size resumes at another.
The vocabulary rows (padded to the TP size) load across sizes because megatron-core marks them
``allow_shape_mismatch``. Step counts, the LR schedule and the RNG state are the common (rank 0)
part.

Loading runs no code planted in a checkpoint: megatron-core's DCP reader goes through
miles-safeload's allow-lists (``_safe_reads``), and its common part is read by ``torch.load``
with torch's default ``weights_only=True`` (megatron-core 0.16: a ``common.pt`` file; 0.19: an item
of the DCP checkpoint, read through the same safe reader).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from miles_safeload import SafeReader

MARK = "metadata.json"  # written last by dist_checkpointing.save: a folder with it is complete
MOMENTS = ("exp_avg", "exp_avg_sq")


def _sharded_params(model: torch.nn.Module, prefix: str) -> tuple[dict[str, Any], dict[int, Any]]:
    """``model``'s sharded state dict, and its sharded entries keyed by ``id(parameter)``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    if hasattr(model, "sharded_state_dict"):  # a megatron-core module
        sd = model.sharded_state_dict(prefix=prefix)
    elif prefix in ("draft.", "mtp."):  # replicated on every rank (no pipeline stages): one writes it
        # buffers too (an MTP layer's expert bias, a draft head's vocabulary and counts): the
        # state dict loads strictly
        tensors = model.state_dict(keep_vars=True)
        sd = {prefix + name: make_sharded_tensor_for_checkpoint(p, prefix + name) for name, p in tensors.items()}
    else:  # the critic: its GPT backbone, plus a norm and head replicated on every rank
        from megatron.core import parallel_state as ps

        sd = model.gpt.sharded_state_dict(prefix=prefix + "gpt.")
        # with pipeline stages only the last one's norm and head are used: it writes them, every
        # stage reads them
        replica = (int(not ps.is_pipeline_last_stage()), ps.get_tensor_model_parallel_rank(),
                   ps.get_data_parallel_rank(with_context_parallel=True))
        for name, p in model.named_parameters():
            if not name.startswith("gpt."):
                sd[prefix + name] = make_sharded_tensor_for_checkpoint(p, prefix + name, replica_id=replica)
    only, _ = extract_sharded_tensors_and_factories(dict(sd))
    by_param = {id(v.data): v for v in only.values() if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    return sd, by_param


def _moments(optim: torch.optim.Optimizer, model: torch.nn.Module, by_param: dict[int, Any],
             prefix: str) -> dict[str, Any]:
    """The AdamW moments as sharded tensors laid out like their parameters (zeros when the
    optimizer has not stepped yet: they are then what a load fills)."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    out = {}
    for name, p in model.named_parameters():
        st = optim.state.setdefault(p, {})
        for k in MOMENTS:
            if k not in st:
                st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out[f"{prefix}{k}.{name}"] = make_sharded_optimizer_tensor(by_param[id(p)], st[k], f"{prefix}{k}")
    return out


def _step(optim: torch.optim.Optimizer) -> float:
    return max((float(st["step"]) for st in optim.state.values() if "step" in st), default=0.0)


def _parts(trainer: Any, draft: bool = True) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer | None]]:
    """What a checkpoint holds; ``draft``: the draft head (``draft.``) or the trained MTP layer
    (``mtp.``) too, if the trainer has one (a checkpoint written without it leaves a new head as it
    was made, an MTP layer as the model's weights gave it)."""
    parts = [("model.", trainer.model, trainer.optim)]
    if trainer.ref is not None:
        parts.append(("ref.", trainer.ref, None))
    if getattr(trainer, "critic", None) is not None:
        parts.append(("critic.", trainer.critic, trainer.critic_optim))
    if draft and trainer.draft is not None:
        parts.append(trainer.draft.checkpoint_part())
    return parts


def _sharded(trainer: Any, draft: bool = True) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for prefix, model, optim in _parts(trainer, draft):
        model_sd, by_param = _sharded_params(model, prefix)
        sd[prefix] = model_sd
        if optim is not None:
            sd[prefix + "optim"] = _moments(optim, model, by_param, prefix + "optim.")
    return sd


def save(trainer: Any, path: str) -> None:
    """Collective: every rank writes its shards; rank 0 the common part."""
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    stepped = {id(p) for _, _, o in _parts(trainer) if o is not None for p, st in o.state.items() if st}
    sd = _sharded(trainer)
    sd["common"] = {
        "step": _step(trainer.optim), "sched": trainer.sched.state_dict(), "rng": torch.get_rng_state(),
        "ref": trainer.ref is not None, "critic": getattr(trainer, "critic", None) is not None,
        "critic_step": _step(trainer.critic_optim) if getattr(trainer, "critic", None) is not None else 0.0,
        "draft": trainer.draft is not None,
        "draft_part": trainer.draft.checkpoint_part()[0] if trainer.draft is not None else None,
        "draft_step": _step(trainer.draft.optim) if trainer.draft is not None else 0.0,
        "layout": {"tensor_parallel": trainer.tp, "expert_parallel": trainer.ep}}
    if trainer.device.type == "cuda":
        sd["common"]["cuda_rng"] = torch.cuda.get_rng_state(trainer.device)
    dist_checkpointing.save(sd, path)
    for _, _, optim in _parts(trainer):  # moments made only to be saved: AdamW starts them itself
        if optim is not None:
            for p in [p for p in optim.state if id(p) not in stepped]:
                del optim.state[p]
    trainer.barrier()


@contextlib.contextmanager
def _safe_reads() -> Iterator[list[SafeReader]]:
    """While it is open, megatron-core's torch_dist strategy reads checkpoints through SafeReaders
    (the list holds them, to tell what they refused). The strategy builds its own DCP reader, whose
    ``.metadata`` is a plain ``pickle.load``, through this one module function."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as strategy
    from miles import MilesError

    if not callable(getattr(strategy, "_get_filesystem_reader", None)):
        raise MilesError("this megatron-core no longer builds its checkpoint reader through "
                         "_get_filesystem_reader, so its checkpoints cannot be loaded safely; install "
                         "megatron-core 0.16 (pip install 'megatron-core>=0.16,<0.17')")
    # megatron-core 0.19 reads the common part through DCP too, with serialization's own import of the function
    modules = [m for m in (strategy, serialization) if callable(getattr(m, "_get_filesystem_reader", None))]
    made: list[SafeReader] = []

    # megatron-core 0.19 also passes the strategy's ``async_strategy``, which a SafeReader does not need
    def reader(checkpoint_dir: Any, cache_metadata: bool = False, **_: Any) -> SafeReader:
        made.append(SafeReader(checkpoint_dir))  # it caches its metadata anyway
        return made[-1]

    originals = [(m, m._get_filesystem_reader) for m in modules]
    for m in modules:
        m._get_filesystem_reader = reader
    try:
        yield made
    finally:
        for m, original in originals:
            m._get_filesystem_reader = original


def _safely(read: Any, *args: Any) -> Any:
    """``read(*args)`` (a megatron-core checkpoint read) through SafeReaders, raising what one refused
    rather than the exception DCP wraps it in."""
    with _safe_reads() as readers:
        try:
            return read(*args)
        except BaseException:
            refused = next((r.refused for r in readers if r.refused), None)
            if refused is None:
                raise
            raise refused from None


def load(trainer: Any, path: str) -> None:
    """Collective: every rank reads its shards of the checkpoint's global tensors."""
    from megatron.core import dist_checkpointing
    from miles import MilesError

    if not os.path.exists(os.path.join(path, MARK)):
        raise MilesError(f"{path} is not a megatron trainer checkpoint (no {MARK}); a checkpoint of "
                         f"another trainer cannot be resumed with trainer.name=megatron")
    common = _safely(dist_checkpointing.load_common_state_dict, path)["common"]
    if common["ref"] and trainer.ref is None:
        trainer.snapshot_reference()  # the target layout; its values come from the checkpoint
    if common["critic"] and hasattr(trainer, "build_critic"):  # else a run without critic resumes
        trainer.build_critic()
    # the draft part a checkpoint holds, if this trainer trains the same kind (a head, or MTP layers)
    draft = (bool(common.get("draft")) and trainer.draft is not None
             and common.get("draft_part", "draft.") == trainer.draft.checkpoint_part()[0])
    sd = _sharded(trainer, draft)
    loaded = _safely(dist_checkpointing.load, sd, path)
    with torch.no_grad():
        for prefix, model, optim in _parts(trainer, draft):
            weights = {k.removeprefix(prefix): v for k, v in loaded[prefix].items()}
            missing, unexpected = model.load_state_dict(weights, strict=False)
            if [k for k in missing if not k.endswith("_extra_state")] or unexpected:
                raise MilesError(f"{path}: the checkpoint's weights do not match the model (missing "
                                 f"{missing[:3]}, unexpected {unexpected[:3]})")
            if optim is not None:
                _restore(optim, model, loaded[prefix + "optim"], prefix + "optim.",
                         common[{"critic.": "critic_step", "draft.": "draft_step", "mtp.": "draft_step"}.get(
                             prefix, "step")])
    trainer.weights_changed()
    trainer.sched.load_state_dict(common["sched"])
    torch.set_rng_state(common["rng"])
    if "cuda_rng" in common and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(common["cuda_rng"], trainer.device)


def _restore(optim: torch.optim.Optimizer, model: torch.nn.Module, moments: dict[str, torch.Tensor],
             prefix: str, step: float) -> None:
    """Loaded moments into AdamW's state (cleared when the checkpoint's optimizer never stepped)."""
    for name, p in model.named_parameters():
        if step <= 0:
            optim.state.pop(p, None)
            continue
        st = optim.state[p]
        for k in MOMENTS:
            st[k].copy_(moments[f"{prefix}{k}.{name}"])
        st["step"] = torch.tensor(step, dtype=torch.float32, device=p.device)

