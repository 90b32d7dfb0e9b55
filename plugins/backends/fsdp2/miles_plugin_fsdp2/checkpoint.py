"""Trainer checkpoints in torch.distributed.checkpoint (DCP) format, at every world size.

DCP stores each tensor with its global shape and every rank's chunks, so a checkpoint written by
N ranks loads at M ranks (including 1, plain tensors). Model, optimizer and the reference model
go through DCP; the LR scheduler and RNG state are a small ``trainer_state.pt`` written by rank 0.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

EXTRA = "trainer_state.pt"


@contextlib.contextmanager
def _quiet():
    # without a process group DCP warns that it assumes a single process: that is the intent
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*(disabled|unavailable|uninitialized).*")
        yield


def save(trainer: Any, path: str) -> None:
    """Collective: every rank writes its shards into ``path``; rank 0 adds the small extras."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    os.makedirs(path, exist_ok=True)
    trainer.reshard()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optim)
    state = {"model": model_sd, "optim": optim_sd}
    if trainer.ref is not None:
        state["ref"] = get_model_state_dict(trainer.ref)
    with _quiet():
        dcp.save(state, checkpoint_id=path)
    if trainer.rank == 0:
        extra = {"sched": trainer.sched.state_dict(), "rng": torch.get_rng_state(),
                 "has_ref": trainer.ref is not None, "world_size": trainer.world_size}
        if torch.cuda.is_available() and trainer.device.type == "cuda":
            extra["cuda_rng"] = torch.cuda.get_rng_state(trainer.device)
        torch.save(extra, os.path.join(path, EXTRA))
    trainer.barrier()


def load(trainer: Any, path: str) -> None:
    """Collective: restore what :func:`save` wrote, resharded to this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)

    from miles import MilesError

    extra_path = os.path.join(path, EXTRA)
    if not os.path.exists(extra_path):
        raise MilesError(f"{path} is not an fsdp2 trainer checkpoint (no {EXTRA}); it may come from "
                         f"an older miles that wrote trainer.pt: start a fresh run.out_dir")
    extra = torch.load(extra_path, weights_only=False)
    if extra["has_ref"]:
        trainer.snapshot_reference()  # the target layout; its values come from the checkpoint
    trainer.reshard()
    # get_state_dict gives the optimizer its (zero) state first, so DCP has tensors to fill
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optim)
    state = {"model": model_sd, "optim": optim_sd}
    if trainer.ref is not None:
        state["ref"] = get_model_state_dict(trainer.ref)
    with _quiet():
        dcp.load(state, checkpoint_id=path)
    set_state_dict(trainer.model, trainer.optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if trainer.ref is not None:
        set_model_state_dict(trainer.ref, state["ref"])
    trainer.sched.load_state_dict(extra["sched"])
    torch.set_rng_state(extra["rng"])
    if "cuda_rng" in extra and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(extra["cuda_rng"], trainer.device)


def read_model(path: str, key: str = "model") -> dict[str, torch.Tensor]:
    """The full weights (HF names) of a checkpoint, in one process, no process group needed.
    ``key``: ``"model"`` (the policy) or ``"ref"``."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(path).read_metadata()
    want = {k[len(key) + 1:]: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if k.startswith(key + ".") and isinstance(m, dcp.TensorStorageMetadata)}
    with _quiet():
        dcp.load({key: want}, checkpoint_id=path, no_dist=True)
    return want
