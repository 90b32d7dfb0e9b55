"""Trainer side of the ``disk`` transport: stream weights into one atomically committed version folder."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from miles import MilesError
from safetensors.torch import save_file

from . import layout
from .reader import checksum, dtype_name, read_manifest


@dataclass
class WriteStats:
    folder: str
    bytes_written: int
    tensors_written: int
    total_bytes: int


class _Shards:
    """Packs tensors into shards of at most ``limit`` bytes inside ``tmp``; only the open shard is
    held in memory."""

    def __init__(self, tmp: str, folder: str, limit: int):
        self.tmp, self.folder, self.limit = tmp, folder, limit
        self.open: dict[str, torch.Tensor] = {}
        self.size = self.index = 0
        self.storages: set[int] = set()

    def add(self, key: str, t: torch.Tensor) -> str:
        """Queue ``t`` under ``key``; returns the shard's path relative to the weights root."""
        nbytes = t.numel() * t.element_size()
        if self.open and self.size + nbytes > self.limit:
            self.flush()
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr in self.storages:
            t = t.clone()  # safetensors refuses tensors sharing memory within one file
        self.storages.add(t.untyped_storage().data_ptr())
        self.open[key] = t
        self.size += nbytes
        return f"{self.folder}/{self._name()}"

    def flush(self) -> None:
        if not self.open:
            return
        path = os.path.join(self.tmp, self._name())
        save_file(self.open, path, metadata={"format": "pt"})
        layout.fsync_path(path)
        self.open, self.size, self.storages = {}, 0, set()
        self.index += 1

    def _name(self) -> str:
        return f"model-{self.index:05d}.safetensors"


def write_version(root: str, named: Iterable[tuple[str, torch.Tensor]], version: int, *,
                  shard_mb: int, delta: bool, keep: int, checksums: bool = True) -> WriteStats:
    """Write ``named`` as ``version``, repoint LATEST at it, prune old folders.

    ``checksums`` puts each tensor's blake2b in the manifest (verification and ``delta`` need
    them; hashing runs at about half the speed of the disk write, so a plain sync skips it).

    Until the final rename nothing outside ``<folder>.tmp`` changes, so an exception (or a crash)
    leaves the previous version as LATEST, intact.
    """
    os.makedirs(root, exist_ok=True)
    prev = _previous(root) if delta else {}
    folder = layout.new_folder(root, version)
    tmp = os.path.join(root, folder + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        shards = _Shards(tmp, folder, shard_mb << 20)
        tensors, stats = _pack(named, shards, prev, checksums or delta)
        shards.flush()
        stats.folder = folder
        layout.write_manifest(tmp, {"format": "miles-disk/1", "version": version,
                                    "total_bytes": stats.total_bytes, "tensors": tensors})
        layout.fsync_path(tmp)
        os.replace(tmp, os.path.join(root, folder))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    layout.fsync_path(root)
    layout.write_atomic(os.path.join(root, layout.LATEST), folder + "\n")
    layout.prune(root, folder, keep, layout.referenced({"tensors": tensors}))
    return stats


def _previous(root: str) -> dict[str, dict[str, Any]]:
    """Tensor entries of the newest manifest, or {} when there is none yet."""
    if layout.latest(root) is None:
        return {}
    try:
        return read_manifest(root)["tensors"]
    except MilesError:
        return {}  # an unreadable previous version only costs a full write


def _pack(named: Iterable[tuple[str, torch.Tensor]], shards: _Shards, prev: dict[str, dict[str, Any]],
          checksums: bool) -> tuple[dict[str, dict[str, Any]], WriteStats]:
    tensors: dict[str, dict[str, Any]] = {}
    # the same tensor twice (tied embeddings), or with checksums identical bytes (all-zero
    # biases): stored once
    written: dict[tuple, dict[str, Any]] = {}
    stats = WriteStats("", 0, 0, 0)
    for name, t in named:
        if name in tensors:
            raise MilesError(f"weight sync: the trainer yielded tensor {name} twice")
        same = ("storage", t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        t = t.detach().to("cpu").contiguous()
        entry = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "nbytes": t.numel() * t.element_size()}
        if checksums:
            entry["blake2b"] = checksum(t)
        ident = (entry["blake2b"], entry["dtype"], tuple(entry["shape"])) if checksums else same
        old = prev.get(name)
        if checksums and old is not None and (old.get("blake2b"), old["dtype"], tuple(old["shape"])) == ident:
            entry.update(file=old["file"], key=old["key"])
        elif ident in written:
            entry.update(file=written[ident]["file"], key=written[ident]["key"])
        else:
            entry.update(file=shards.add(name, t), key=name)
            written[ident] = entry
            stats.bytes_written += entry["nbytes"]
            stats.tensors_written += 1
        stats.total_bytes += entry["nbytes"]
        tensors[name] = entry
    return tensors, stats
