"""Colocated weight sync: by reference into an in-process engine, through shared memory (CPU) or
CUDA IPC (GPU) into an engine process on the same host."""
from __future__ import annotations

import time
from typing import Any, Sequence

import miles_wire as W

from .config import TensorSyncConfig

__all__ = ["TensorSyncConfig", "TensorTransport"]


class TensorTransport:
    def __init__(self, cfg: TensorSyncConfig):
        self.cfg = cfg
        self._pool = None  # shared memory segments, made at the first sync to an engine process
        self._shares = None  # CUDA IPC handles of the trainer's weights, made at the first GPU sync
        self._parity = 0

    def sync(self, trainer: Any, engines: Sequence[Any], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        named = trainer.named_weights()
        if not W.is_sender(trainer):
            for _ in named:  # a collective: every rank iterates it
                pass
            return {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_bytes": 0.0}
        local = [e for e in engines if not W.is_remote(e)]
        remote = [e for e in engines if W.is_remote(e)]
        want: dict[str, str] = {}
        kept: list = []
        nbytes = 0
        for index, bucket in enumerate(W.buckets(named, self.cfg.bucket_mb << 20)):
            nbytes += sum(W.nbytes(t) for _, t in bucket)
            if self.cfg.verify:
                want.update((n, W.checksum(t)) for n, t in bucket)
            if local:
                kept.extend(bucket)  # by reference: the engine copies in place
            if remote:
                self._send(index, bucket, remote, version)
        for engine in local:
            engine.load_weights(kept, version)
        if self.cfg.adopt:
            self._parity ^= 1  # the next version goes to the segments engines do not view now
        if self.cfg.verify:
            W.verify(engines, want, version)
        return {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_bytes": float(nbytes)}

    def _send(self, index: int, bucket: list, engines: Sequence[Any], version: int) -> None:
        import torch

        from .handoff import CudaShares, SegmentPool, cuda_payload, shm_payload

        keep = None
        if all(t.is_cuda for _, t in bucket):
            if self._shares is None:
                self._shares = CudaShares()
            payload = self._shares.payload(index, bucket)
            if payload is None:
                payload, keep = cuda_payload(bucket)
            else:
                torch.cuda.synchronize(bucket[0][1].device)  # the engine reads the live tensors
        else:
            if self._pool is None:
                self._pool = SegmentPool()
            payload = shm_payload(self._pool, (index, self._parity), bucket, self.cfg.adopt)
        W.parallel([lambda e=e: e.update_weights_from_tensor([payload], load_format=payload["format"],
                                                              weight_version=version)
                    for e in engines])
        del keep  # the engines have copied out of the trainer's GPU buffer

    def close(self) -> None:
        """Unlink the shared memory segments (also done when the transport is collected)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
