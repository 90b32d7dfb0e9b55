"""Weight sync by torch.distributed broadcast from trainer rank 0 (group rank 0) to engines
(group ranks 1..N), through a group of their own: the trainer's default group, if any, is
never involved, so a multi-rank trainer and one-process engines join it alike.

Per bucket, the engines are told what is coming (``update_weights_from_distributed``, one
thread per engine: the call returns once the bytes are in) while this thread broadcasts them,
following ``miles_wire.wire_plan``: small tensors packed into one uint8 buffer, large ones
each on its own, straight from the trainer's tensor.

Engines that take a whole sync in one call (``accepts_buckets``: the torch engine, ``miles
serve``) are told every bucket at once from the second sync on (a sync's buckets are those of
the one before). Then no bucket waits for an engine's answer: the broadcasts are queued back to
back, packing one bucket (two send buffers, alternating) while the previous one is on the wire,
and the host waits once, at the end.
"""
from __future__ import annotations

import secrets
import sys
import time
from typing import Any, Sequence

import miles_wire as W
from miles import MilesError
from miles.protocols import ReceivesWeights, ServerGroup

from .config import BroadcastSyncConfig

# packed-vs-direct threshold when pack_mb is None: a direct gloo broadcast costs ~0.1 ms of
# latency; on GPUs any per-tensor work (a broadcast, a copy) costs more than moving a typical
# tensor, while packing a whole bucket takes a few kernels at device-copy speed and a torch
# engine receives the packed bucket straight into its parameters (see benchmarks/weight_sync.py)
AUTO_PACK_BYTES = {"gloo": 1 << 20, "nccl": 1 << 62}


class BroadcastTransport:
    def __init__(self, cfg: BroadcastSyncConfig):
        self.cfg = cfg
        self._group = self._store = self._name = self._backend = None
        self._engines: list[Any] = []
        self._members: list[tuple[int, int]] = []
        self._send_bufs: list[Any] = [None, None]  # alternate buckets pack into alternate buffers
        self._works: list = [[], []]  # per send buffer: (works, tensors) of its last broadcast
        self._sequence: list[tuple] = []  # the last sync's bucket keys, in order
        self._accepts = False  # every engine of the group takes a whole sync in one call
        self._broken = False
        self._waited = 0.0
        self._plans: dict[tuple, tuple] = {}  # per bucket: wire dtypes, names, shapes, plan
        self._views: dict[tuple, list] = {}  # per bucket and send buffer: its packed slots

    def sync(self, trainer: Any, engines: Sequence[Any], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        named = trainer.named_weights()
        if not W.is_sender(trainer) or not engines:
            for _ in named:  # a collective: every trainer rank iterates it
                pass
            return {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_bytes": 0.0}
        want: dict[str, str] = {}
        nbytes, connect, gather, self._waited = 0, 0.0, [0.0], 0.0
        sent: list[tuple] = []  # this sync's bucket keys, in order
        ahead = None  # (calls, deadline) of a sync announced in one call per engine
        self._works = [[], []]
        limit = self.cfg.bucket_mb << 20
        try:
            if self._group is not None and not self._broken and self._members == W.members(engines):
                ahead = self._announce(version)  # before the first bucket is gathered
            # a small first bucket: the wire starts while the rest is gathered and packed
            for bucket in W.buckets(W.timed(named, gather), limit, limit // 8):
                if (self._group is None or self._broken or self._members != W.members(engines)):
                    c0 = time.perf_counter()
                    self._connect(engines, bucket[0][1])
                    connect += time.perf_counter() - c0
                if ahead is None:  # with the sync announced, gathering overlaps the broadcasts
                    W.ready(bucket, gather)
                if self.cfg.verify:
                    want.update((n, W.checksum(t.to(self._wire_dtype(t)))) for n, t in bucket)
                size, key = self._send(bucket, version, ahead, len(sent))
                nbytes += size
                sent.append(key)
            if ahead is not None:
                self._finish(ahead, len(sent))
        except BaseException as e:
            self._broken = True  # its state is unknown after a failed broadcast: start afresh
            self._sequence = []
            down = W.servers_down(engines) if isinstance(e, Exception) else []
            if not down:
                raise
            for _ in named:  # the other trainer ranks are still in the collective: finish it with them
                pass
            # the engine's client keeps its servers out until they are back and re-synced
            # (EngineRestarted in the next rollout), so the run goes on
            print(f"miles broadcast: the push of weight version {version} failed with engine server(s) "
                  f"{', '.join(down)} down ({type(e).__name__}: {e}); it is redone once they are back",
                  file=sys.stderr)
            return {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_bytes": float(nbytes),
                    "weight_sync_failed": 1.0}
        self._sequence = sent
        if self.cfg.verify:
            W.verify(engines, want, version)
        return {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_bytes": float(nbytes),
                "weight_sync_connect_seconds": connect, "weight_sync_gather_seconds": gather[0],
                "weight_sync_engine_wait_seconds": self._waited}

    def _announce(self, version: int) -> tuple | None:
        """Tell every engine the whole sync (the previous sync's buckets) in one call, when all
        take ``buckets``; None otherwise (or on a first sync)."""
        if not self._sequence or not self._accepts:
            return None
        plans = [self._plans[k] for k in self._sequence]
        names = [n for k in self._sequence for n in k[0]]
        dtypes = [d for p in plans for d in p[1]]
        shapes = [s for p in plans for s in p[2]]
        counts = [len(k[0]) for k in self._sequence]
        calls = W.Calls([lambda e=e: e.update_weights_from_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=self._name, weight_version=version,
            pack_below=self._pack_below(), buckets=counts) for e in self._engines])
        return calls, time.monotonic() + self.cfg.timeout_s

    def _finish(self, ahead: tuple, count: int) -> None:
        """Wait for an announced sync's broadcasts and the engines' answers."""
        calls, deadline = ahead
        if count != len(self._sequence):
            raise MilesError(f"weight sync: the trainer sent {count} bucket(s) where the previous sync "
                             f"had {len(self._sequence)}; its weights changed between syncs")
        check = self._checker(calls, deadline)
        for works in self._works:
            W.wait_all(works[0] if works else [], check)
        t0 = time.perf_counter()  # the bytes are in; the engines' calls still have to return
        calls.join(max(1.0, deadline - time.monotonic()))
        self._waited += time.perf_counter() - t0

    def _connect(self, engines: Sequence[Any], first: Any) -> None:
        """A new group: this process is rank 0 and hosts the store; the engines take the next
        ranks in order, ``engine.num_weight_ranks`` each (a client of several servers: one per
        server, from its ``rank_offset`` on; 1 for an engine that is not a ``ServerGroup``)."""
        self.close()
        cfg = self.cfg
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if first.is_cuda else "gloo")
        sizes = [int(e.num_weight_ranks) if isinstance(e, ServerGroup) else 1 for e in engines]
        offsets = [1 + sum(sizes[:i]) for i in range(len(engines))]
        world = 1 + sum(sizes)
        store = W.open_store(cfg.master_address, cfg.master_port, world, is_master=True,
                             timeout_s=cfg.timeout_s)
        name = f"miles-broadcast-{secrets.token_hex(4)}"
        joins = [lambda e=e, i=i: e.init_weights_update_group(
            master_address=cfg.master_address, master_port=store.port, rank_offset=offsets[i],
            world_size=world, group_name=name, backend=backend) for i, e in enumerate(engines)]
        # our own join runs on a thread too, so an engine that fails at once fails the sync at
        # once instead of after the rendezvous timeout
        group = W.Calls([lambda: W.new_group(store, 0, world, name, backend, cfg.timeout_s), *joins])
        self._group = group.join(cfg.timeout_s)[0]
        self._store, self._name, self._backend, self._engines = store, name, backend, list(engines)
        self._members = W.members(engines)
        # after the join: a client learns there whether every server takes buckets
        self._accepts = all(isinstance(e, ReceivesWeights) and e.accepts_buckets for e in engines)
        self._broken = False

    def _send(self, bucket: list, version: int, ahead: tuple | None, index: int) -> tuple[int, tuple]:
        """Broadcast bucket ``index`` (announced ``ahead``, else now, to engines that receive it
        meanwhile); its bytes and key. Announced, it is only queued: its works are waited for
        before its send buffer is packed again, and at the end of the sync."""
        names = [n for n, _ in bucket]
        tensors = [t for _, t in bucket]
        if self._backend == "gloo":
            tensors = [t.cpu() for t in tensors]
        key, (wire, dtypes, shapes, plan, nbytes) = self._plan(names, tensors)
        if ahead is None:
            calls = W.Calls([lambda e=e: e.update_weights_from_distributed(
                names=names, dtypes=dtypes, shapes=shapes, group_name=self._name,
                weight_version=version, pack_below=self._pack_below()) for e in self._engines])
            deadline = time.monotonic() + self.cfg.timeout_s
        else:
            calls, deadline = ahead
            if index >= len(self._sequence) or self._sequence[index] != key:
                raise MilesError(f"weight sync: bucket {index} ({names[0]} ...) is not the one the "
                                 f"previous sync sent there; the trainer's weights changed between syncs")
        check = self._checker(calls, deadline)
        slot = index % 2
        import torch

        with torch.no_grad():
            W.wait_all(self._works[slot][0] if self._works[slot] else [], check, host=False)
            out = [tensors[i].detach().to(wire[i]).contiguous() for i in plan.direct]
            if plan.packed:
                buf = self._buffer(slot, plan.packed_bytes, tensors[0].device)
                torch._foreach_copy_(self._slots(names, buf, plan, wire, shapes),
                                     [tensors[i] for i in plan.packed])
                out.insert(0, buf)
        works = W.post(self._group, out)
        self._works[slot] = (works, out)  # the tensors stay alive until their broadcast is done
        if ahead is None:
            W.wait_all(works, check)
            t0 = time.perf_counter()  # the bytes are in; the engines' calls still have to return
            calls.join(max(1.0, deadline - time.monotonic()))
            self._waited += time.perf_counter() - t0
        return nbytes, key

    def _checker(self, calls: Any, deadline: float) -> Any:
        """A check for ``wait_all``: an engine call that failed, or the deadline, ends the wait."""
        def check() -> None:
            calls.check()
            if time.monotonic() > deadline:
                raise MilesError(f"weight sync: engines did not take part in a broadcast within "
                                 f"{self.cfg.timeout_s:.0f} s (transport.timeout_s)")

        return check

    def _plan(self, names: list[str], tensors: list) -> tuple[tuple, tuple]:
        """A bucket's key, and its wire dtypes, their names, shapes, wire plan and bytes: the same
        buckets come at every sync, so they are worked out once per bucket (no per-tensor work
        after that)."""
        key = (tuple(names), tensors[0].dtype, tensors[-1].dtype, self._pack_below())
        got = self._plans.get(key)
        if got is None:
            wire = [self._wire_dtype(t) for t in tensors]
            dtypes = [W.dtype_name(d) for d in wire]
            shapes = [list(t.shape) for t in tensors]
            size = sum(t.numel() * d.itemsize for t, d in zip(tensors, wire))
            got = self._plans[key] = (wire, dtypes, shapes, W.wire_plan(dtypes, shapes, self._pack_below()), size)
        return key, got

    def _slots(self, names: list[str], buf: Any, plan: W.WirePlan, wire: list, shapes: list) -> list:
        """Typed views of the send buffer where the bucket's packed tensors go (kept per bucket
        while the buffer stays the same)."""
        key = (tuple(names), buf.data_ptr(), buf.numel())
        slots = self._views.get(key)
        if slots is None:
            slots = self._views[key] = W.views(buf, [wire[i] for i in plan.packed],
                                               [shapes[i] for i in plan.packed], plan.offsets)
        return slots

    def _wire_dtype(self, t: Any) -> Any:
        """The dtype ``t`` travels as (``transport.dtype`` for floating-point tensors)."""
        return W.to_dtype(self.cfg.dtype) if self.cfg.dtype and t.is_floating_point() else t.dtype

    def _pack_below(self) -> int:
        if self.cfg.pack_mb is None:
            return AUTO_PACK_BYTES[self._backend]
        return int(self.cfg.pack_mb * (1 << 20))

    def _buffer(self, slot: int, size: int, device: Any) -> Any:
        """Send buffer ``slot`` (0 or 1), at least ``size`` bytes."""
        import torch

        buf = self._send_bufs[slot]
        if buf is None or buf.numel() < size or buf.device != device:
            buf = self._send_bufs[slot] = torch.empty(size, dtype=torch.uint8, device=device)
            self._views.clear()  # views of the old buffer (its address may come back)
        return buf[:size]

    def close(self) -> None:
        """Leave the group: engines destroy their side (errors ignored: they may be gone)."""
        if self._group is None:
            return
        name, engines, group = self._name, self._engines, self._group
        self._group, self._engines = None, []
        try:
            W.parallel([lambda e=e: e.destroy_weights_update_group(group_name=name) for e in engines],
                       timeout_s=30)
        except Exception:  # noqa: BLE001 - best effort
            pass
        if hasattr(group, "shutdown"):
            group.shutdown()
