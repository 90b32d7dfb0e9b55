"""Weight sync through a folder: the trainer writes a version, every engine loads it back."""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Sequence

import miles_wire as W

from .config import DiskSyncConfig
from .reader import load_version, read_manifest
from .writer import write_version


def weights_dir(cfg: DiskSyncConfig, out_dir: str | os.PathLike | None = None) -> str:
    if cfg.dir:
        return cfg.dir
    if out_dir is not None:
        return os.path.join(os.fspath(out_dir), "weights")
    # unique per transport so that concurrent runs on one machine never share versions
    return os.path.join(tempfile.mkdtemp(prefix="miles-disk-"), "weights")


class DiskTransport:
    def __init__(self, cfg: DiskSyncConfig, out_dir: str | os.PathLike | None = None):
        self.cfg = cfg
        self.dir = weights_dir(cfg, out_dir)
        os.makedirs(self.dir, exist_ok=True)

    def sync(self, trainer: Any, engines: Sequence[Any], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        named = trainer.named_weights()
        if not W.is_sender(trainer):
            for _ in named:  # a collective: every trainer rank iterates it, rank 0 writes
                pass
            return {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_bytes": 0.0}
        stats = write_version(self.dir, named, version, shard_mb=self.cfg.shard_mb,
                              delta=self.cfg.delta, keep=self.cfg.keep, checksums=self.cfg.verify)
        t1 = time.perf_counter()
        # each engine reads the newest manifest on its own; engine processes are asked at once
        remote = [e for e in engines if W.is_remote(e)]
        loads = [lambda e=e: e.update_weights_from_disk(model_path=self.dir, weight_version=version)
                 for e in remote]
        calls = W.Calls(loads) if loads else None
        for engine in engines:
            if not W.is_remote(engine):
                engine.load_weights(load_version(self.dir, verify=self.cfg.verify), version)
        if calls is not None:
            calls.join()
        t2 = time.perf_counter()
        if self.cfg.verify:
            # the manifest holds the trainer's checksums, computed while writing
            tensors = read_manifest(self.dir, version)["tensors"]
            W.verify(engines, {n: e["blake2b"] for n, e in tensors.items()}, version)
        total = stats.total_bytes
        return {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_write_seconds": t1 - t0,
                "weight_sync_load_seconds": t2 - t1, "weight_sync_bytes": float(stats.bytes_written),
                "weight_sync_tensors_written": float(stats.tensors_written),
                "weight_sync_delta_fraction": stats.bytes_written / total if total else 0.0}
