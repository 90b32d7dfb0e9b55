"""Payloads of ``engine.update_weights_from_tensor`` for an engine process on the trainer's host.

CPU tensors: a bucket's bytes are copied into a POSIX shared memory segment the trainer keeps
(a fresh segment costs a page fault per page, so segments are reused), and the engine gets a
small JSON descriptor: segment name, per tensor its name, dtype, shape and byte offset. With
``adopt`` the trainer alternates two segments per bucket: the engine's parameters become views of
the segment written for version v, so version v+1 goes to the other one. CUDA tensors: the bucket
is packed into one GPU buffer whose CUDA IPC handle (``reduce_tensor``) travels with the same
per-tensor offsets; the engine copies out of the trainer's GPU memory into its parameters. When
the bucket's tensors are the trainer's own parameters (they stay in place from sync to sync), no
packing at all: handles of their storages are sent once, and the engine copies straight out of
them at every sync (``CudaShares``). Formats are documented in the torch engine's ``weights``
module (the receiving side).
"""
from __future__ import annotations

import base64
import os
import pickle
import secrets
import weakref
from typing import Any, Sequence

import miles_wire as W
import torch
from miles import MilesError

SHM_FORMAT, CUDA_IPC_FORMAT = W.SHM_FORMAT, W.CUDA_IPC_FORMAT


class SegmentPool:
    """Shared memory segments owned by the trainer, keyed by (bucket, parity); unlinked when
    the pool is closed or garbage collected (and by Python's resource tracker after a crash)."""

    def __init__(self):
        self.prefix = f"miles_{os.getpid()}_{secrets.token_hex(4)}"
        self.segments: dict[Any, tuple[Any, torch.Tensor]] = {}
        self.created = 0
        self._finalizer = weakref.finalize(self, _close_all, self.segments)

    def get(self, key: Any, size: int) -> tuple[str, torch.Tensor]:
        """(segment name, uint8 tensor of ``size`` bytes over it)."""
        from multiprocessing import shared_memory

        have = self.segments.get(key)
        if have is None or have[1].numel() < size:
            if have is not None:
                _close(self.segments.pop(key))
            _check_room(size)
            self.created += 1
            shm = shared_memory.SharedMemory(create=True, size=max(size, 1),
                                             name=f"{self.prefix}_{self.created}")
            have = self.segments[key] = (shm, torch.frombuffer(shm.buf, dtype=torch.uint8))
        return have[0].name, have[1][:size]

    def close(self) -> None:
        self._finalizer()


def _check_room(size: int) -> None:
    """A segment larger than the room left in /dev/shm is created fine but kills the process
    with SIGBUS at the first write past the limit: refuse it with a way out instead."""
    import shutil

    if not os.path.isdir("/dev/shm"):
        return
    free = shutil.disk_usage("/dev/shm").free
    if size > free:
        raise MilesError(f"tensor transport: a {size / 2**20:.0f} MiB shared memory segment does not "
                         f"fit in /dev/shm ({free / 2**20:.0f} MiB free). Enlarge it (docker run "
                         "--shm-size), lower transport.bucket_mb, set transport.adopt=false (one segment set "
                         "instead of two), or use transport.name=broadcast")


def _close(entry: tuple[Any, torch.Tensor]) -> None:
    shm, buf = entry
    del buf  # the tensor holds an export of the mapping; close() needs it released
    try:
        shm.close()
    except BufferError:  # a view still alive somewhere: the mapping goes with the process
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def _close_all(segments: dict) -> None:
    while segments:
        _close(segments.popitem()[1])


def _layout(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[dict], list, int]:
    """Per tensor {name, dtype, shape, offset} in a packed buffer, the (tensor, offset) pairs to
    copy, and the buffer's size. Tensors sharing memory (tied embeddings) are stored once."""
    entries, first, slots, end = [], {}, [], 0
    for name, t in bucket:
        ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.data_ptr() else None
        off = first.get(ident) if ident is not None else None
        if off is None:
            off, end = end, W.align(end + W.nbytes(t))
            slots.append((t, off))
            if ident is not None:
                first[ident] = off
        entries.append({"name": name, "dtype": W.dtype_name(t.dtype), "shape": list(t.shape), "offset": off})
    return entries, slots, end


def shm_payload(pool: SegmentPool, key: Any, bucket: Sequence[tuple[str, torch.Tensor]],
                adopt: bool) -> dict:
    """Copy ``bucket`` into the pool's segment ``key``; the descriptor the engine reads it by."""
    entries, slots, size = _layout(bucket)
    segment, buf = pool.get(key, size)
    W.pack([t for t, _ in slots], [o for _, o in slots], buf)
    return {"format": SHM_FORMAT, "segment": segment, "size": size, "adopt": adopt, "tensors": entries}


class CudaShares:
    """CUDA IPC handles of the trainer's own weight storages, per bucket: the engine copies
    straight out of the trainer's parameters (one device copy in all, no packing). Handles are
    made once and reused while the bucket's tensors stay where they are (an optimizer updates
    them in place); a bucket whose tensors move (fresh tensors every sync, e.g. gathered from
    shards) is packed into one buffer from then on, as ``cuda_payload`` does."""

    def __init__(self):
        self.cache: dict[int, tuple[tuple, dict]] = {}  # bucket index -> (where its tensors are, payload)
        self.moving: set[int] = set()

    def payload(self, index: int, bucket: Sequence[tuple[str, torch.Tensor]]) -> dict | None:
        """The descriptor for ``bucket`` (None: pack it instead). Synchronise the trainer's
        device before sending it: the engine reads the live parameters."""
        from torch.multiprocessing.reductions import reduce_tensor

        if index in self.moving or not all(t.is_contiguous() for _, t in bucket):
            return None
        where = tuple((n, t.data_ptr(), t.dtype, tuple(t.shape)) for n, t in bucket)
        hit = self.cache.get(index)
        if hit is not None:
            if hit[0] == where:
                return hit[1]
            self.moving.add(index)
            del self.cache[index]
            return None
        storages: dict[int, tuple[int, Any]] = {}
        entries = []
        for name, t in bucket:
            st = t.untyped_storage()
            k = storages.setdefault(st.data_ptr(), (len(storages), st))[0]
            entries.append({"name": name, "dtype": W.dtype_name(t.dtype), "shape": list(t.shape),
                            "handle": k, "offset": t.storage_offset() * t.element_size()})
        handles = []
        for _, st in storages.values():
            whole = torch.empty(0, dtype=torch.uint8, device=bucket[0][1].device).set_(st)
            handles.append(base64.b64encode(pickle.dumps(reduce_tensor(whole))).decode("ascii"))
        payload = {"format": CUDA_IPC_FORMAT, "handles": handles, "tensors": entries}
        self.cache[index] = (where, payload)
        return payload


def cuda_payload(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[dict, torch.Tensor]:
    """``bucket`` packed into one GPU buffer, and the descriptor holding its CUDA IPC handle.

    One handle per bucket: opening a handle and waiting on its event cost the engine far more
    than copying a small tensor, so per-tensor handles are slow for models of many tensors.
    Keep the buffer alive until the engine has returned (it synchronises before it does).
    """
    from torch.multiprocessing.reductions import reduce_tensor

    entries, slots, size = _layout(bucket)
    buf = torch.empty(size, dtype=torch.uint8, device=slots[0][0].device)
    W.pack([t for t, _ in slots], [o for _, o in slots], buf)
    # reduce_tensor records an event after the packing copies; the engine waits on it
    handle = base64.b64encode(pickle.dumps(reduce_tensor(buf))).decode("ascii")
    return {"format": CUDA_IPC_FORMAT, "handle": handle, "size": size, "tensors": entries}, buf
