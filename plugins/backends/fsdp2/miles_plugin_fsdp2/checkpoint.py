"""Trainer checkpoints in torch.distributed.checkpoint (DCP) format, at every world size.

DCP stores each tensor with its global shape and every rank's chunks, so a checkpoint written by
N ranks loads at M ranks (including 1, plain tensors). Model, optimizer and the reference model
go through DCP, and so does a model spec's own training state (``KeepsTrainingState``, e.g. the
diffusers spec's EMA old policy, under ``spec.``); the LR scheduler state is a small
``trainer_state.json`` and the RNG state ``rng.safetensors``, both written by rank 0.

Nothing is unpickled freely on load, so a planted checkpoint cannot run code: DCP reads through
miles-safeload's ``SafeReader`` (allow-listed ``.metadata``, non-tensor items such as the
optimizer's hyper-parameters only through ``torch.load(weights_only=True)``).
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any

import torch
from miles_safeload import SafeReader
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from miles.protocols import KeepsTrainingState

EXTRA, RNG = "trainer_state.json", "rng.safetensors"


@contextlib.contextmanager
def _quiet():
    # without a process group DCP warns that it assumes a single process: that is the intent
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*(disabled|unavailable|uninitialized).*")
        yield


def _first_line(e: BaseException) -> str:
    """The cause in one line: DCP's CheckpointException text is each rank's whole traceback, whose
    last line is the error itself (a size mismatch, a missing key)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith((" ", "Traceback"))]
    return (lines[-1] if lines else type(e).__name__)[:300]


def save(trainer: Any, path: str) -> None:
    """Collective: every rank writes its shards into ``path``; rank 0 adds the small extras."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
    )

    os.makedirs(path, exist_ok=True)
    trainer.reshard()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optim)
    state = {"model": model_sd, "optim": optim_sd}
    if trainer.ref is not None:
        state["ref"] = get_model_state_dict(trainer.ref)
    spec_state = trainer.spec.training_state(trainer.model) if isinstance(trainer.spec, KeepsTrainingState) else {}
    if spec_state:
        state["spec"] = spec_state
    with _quiet():
        dcp.save(state, checkpoint_id=path)
    if trainer.rank == 0:
        from safetensors.torch import save_file

        extra = {"sched": trainer.sched.state_dict(), "has_ref": trainer.ref is not None,
                 "has_spec_state": bool(spec_state), "world_size": trainer.world_size}
        rng = {"rng": torch.get_rng_state()}
        if torch.cuda.is_available() and trainer.device.type == "cuda":
            rng["cuda_rng"] = torch.cuda.get_rng_state(trainer.device)
        with open(os.path.join(path, EXTRA), "w") as f:
            json.dump(extra, f)
        save_file(rng, os.path.join(path, RNG))
    trainer.barrier()


def load(trainer: Any, path: str) -> None:
    """Collective: restore what :func:`save` wrote, resharded to this world size."""
    import torch.distributed.checkpoint as dcp
    from miles import MilesError
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    extra_path = os.path.join(path, EXTRA)
    if not os.path.exists(extra_path):
        raise MilesError(f"{path} is not an fsdp2 trainer checkpoint (no {EXTRA}); it may come from "
                         f"an older miles: start a fresh run.out_dir")
    with open(extra_path) as f:
        extra = {**json.load(f), **load_file(os.path.join(path, RNG))}
    if extra["has_ref"]:
        trainer.snapshot_reference()  # the target layout; its values come from the checkpoint
    trainer.reshard()
    # get_state_dict gives the optimizer its (zero) state first, so DCP has tensors to fill
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optim)
    state = {"model": model_sd, "optim": optim_sd}
    if trainer.ref is not None:
        state["ref"] = get_model_state_dict(trainer.ref)
    reader = SafeReader(path)
    try:
        with _quiet():
            dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as e:  # e.g. a size mismatch: the model config changed
        if reader.refused or isinstance(e, MilesError):
            raise (reader.refused or e) from None
        raise MilesError(f"trainer checkpoint {path} does not fit this model ({_first_line(e)}); "
                         f"restore the model settings it was written with, or pick a new run.out_dir") from e
    set_state_dict(trainer.model, trainer.optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if trainer.ref is not None:
        set_model_state_dict(trainer.ref, state["ref"])
    if extra.get("has_spec_state") and isinstance(trainer.spec, KeepsTrainingState):
        # full tensors, read by each rank on its own; the spec places them as its model's
        trainer.spec.load_training_state(trainer.model, read_model(path, "spec"))
    trainer.sched.load_state_dict(extra["sched"])
    torch.set_rng_state(extra["rng"])
    if "cuda_rng" in extra and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(extra["cuda_rng"], trainer.device)


def read_model(path: str, key: str = "model") -> dict[str, torch.Tensor]:
    """The full weights (HF names) of a checkpoint, in one process, no process group needed.
    ``key``: ``"model"`` (the policy) or ``"ref"``."""
    import torch.distributed.checkpoint as dcp

    meta = SafeReader(path).read_metadata()
    want = {k[len(key) + 1:]: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if k.startswith(key + ".") and isinstance(m, dcp.TensorStorageMetadata)}
    reader = SafeReader(path)
    try:
        with _quiet():
            dcp.load({key: want}, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException):
        if reader.refused:
            raise reader.refused from None
        raise
    return want
