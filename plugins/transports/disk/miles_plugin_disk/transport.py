"""Weight sync through a folder: the trainer writes a version, every engine loads it back."""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Sequence

from .config import DiskSyncConfig
from .reader import load_version
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
        stats = write_version(self.dir, trainer.named_weights(), version, shard_mb=self.cfg.shard_mb,
                              delta=self.cfg.delta, keep=self.cfg.keep)
        t1 = time.perf_counter()
        for engine in engines:
            # each engine reads the newest manifest on its own, as a remote engine would
            engine.load_weights(load_version(self.dir, verify=self.cfg.verify), version)
        t2 = time.perf_counter()
        total = stats.total_bytes
        return {"weight_sync_seconds": t2 - t0, "weight_sync_write_seconds": t1 - t0,
                "weight_sync_bytes": float(stats.bytes_written),
                "weight_sync_tensors_written": float(stats.tensors_written),
                "weight_sync_delta_fraction": stats.bytes_written / total if total else 0.0}
