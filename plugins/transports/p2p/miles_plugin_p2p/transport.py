"""Weight sync by point-to-point writes: every engine rank registers destinations for the
trainer's tensors with a NIXL agent and publishes them (``engine.p2p_open``: agent metadata,
one ``[address, bytes, device]`` per tensor, a session id); the trainer writes each bucket into
every engine rank (one NIXL transfer per bucket and engine rank, ``workers`` in flight on a thread
pool), then commits the version (``engine.p2p_commit``: staged tensors are copied in, the weight
version is set). Contiguous CPU tensors sent in their own dtype are written from where they lie
(their memory registered with the agent); others are first packed into registered send buffers.

Which trainer rank writes which bucket to which engine rank is ``plan.plan`` (a multi-rank
trainer whose ranks all hold the full weights splits the writes; rank 0 alone talks to the
engines over HTTP and shares their endpoints). A write that fails names the engine and the
bucket; one that failed because the engine's server went down is not an error: that server
misses the version and is re-synced once back (the sglang client keeps it out until then).
"""
from __future__ import annotations

import base64
import os
import queue
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import miles_wire as W
from miles import MilesError
from miles.protocols import ReceivesP2P

from .config import P2PSyncConfig
from .plan import cut, plan

# UCX transport lists per ``transport.transport`` (UCX reads UCX_TLS when an agent is made); the
# torch engine's receiver uses the same lists, so both ends share a transport
UCX_TLS = {"tcp": "tcp,self", "rdma": "rc,ud,self,sm,cuda_copy,cuda_ipc", "auto": None}


def make_agent(name: str, transport: str) -> Any:
    """A thread-safe NIXL agent with the UCX backend, restricted to ``transport`` (plus
    ``cuda_copy`` on a CUDA host: trainer tensors on a GPU are packed into host buffers, but the
    engines' destinations may be GPU memory)."""
    import importlib

    import torch

    tls = UCX_TLS[transport]
    if tls:
        os.environ["UCX_TLS"] = tls + (",cuda_copy" if torch.cuda.is_available() and "cuda_copy" not in tls else "")
    for module in ("nixl_cu12", "nixl_cu13", "nixl._api"):  # CUDA 12 wheel, CUDA 13 wheel, meta-package
        try:
            api = importlib.import_module(module)
            break
        except ImportError:
            continue
    else:
        raise MilesError("transport.name=p2p needs NIXL: pip install -e plugins/transports/p2p (nixl-cu12; "
                         "nixl-cu13 on CUDA 13 hosts)")
    return api.nixl_agent(name, api.nixl_agent_config(
        backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))


class P2PTransport:
    def __init__(self, cfg: P2PSyncConfig):
        self.cfg = cfg
        self._agent: Any = None
        self._remotes: dict[str, str] = {}  # engine agent name -> the metadata it was added with
        self._bufs: list = []  # registered send buffers, one per write in flight
        self._reg: Any = None
        self._src: tuple | None = None  # (key, registration, tensors held) of directly sent tensors
        self._src_last: tuple | None = None  # the last sync's key of directly sent tensors
        self._pool: ThreadPoolExecutor | None = None
        self._opened: tuple | None = None  # (key, owners, infos): the last sync's engine endpoints

    # -- one sync --------------------------------------------------------------------------------
    def sync(self, source: Any, engines: Sequence[Any], version: int) -> dict[str, float]:
        t0, gather = time.perf_counter(), [0.0]
        rank, world = _rank_world(source)
        # every rank iterates the weights (a collective for sharded trainers); the references are
        # kept for the sync, since every engine rank needs the layout before the first write
        items = list(W.timed(source.named_weights(), gather))
        if world == 1 and not W.is_sender(source):
            return {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_bytes": 0.0}
        wire = [self._wire_dtype(t) for _, t in items]
        sizes = [t.numel() * d.itemsize for (_, t), d in zip(items, wire)]
        runs = cut(sizes, int(self.cfg.bucket_mb * (1 << 20)))
        layout = [{"name": n, "dtype": W.dtype_name(d), "shape": [int(x) for x in t.shape]}
                  for (n, t), d in zip(items, wire)]
        hold: _Hold | None = None
        connect = [0.0]
        try:
            # asked on a thread: one trainer rank packs its first bucket meanwhile; several ranks
            # write without waiting for rank 0, so there it is done before the endpoints go out
            hold = _Hold(self, engines) if rank == 0 and engines else None
            args = (source, engines, version, items, wire, runs, layout, rank, world, hold, connect)
            result, retry = self._push(*args, reuse=True)
            if retry:  # the last sync's endpoints were stale (a server restarted unnoticed, or
                result, _ = self._push(*args, reuse=False)  # parameters moved): open afresh, once
        except BaseException:
            self._opened = None  # what failed may have been the endpoints themselves
            raise
        finally:
            if hold is not None:
                hold.release()
        if rank == 0 and self.cfg.verify and engines and "weight_sync_failed" not in result:
            want = {n: W.checksum(t.to(d)) for (n, t), d in zip(items, wire)}
            W.verify(engines, want, version)
        return {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_bytes": float(sum(sizes)),
                "weight_sync_connect_seconds": connect[0], "weight_sync_gather_seconds": gather[0], **result}

    def _push(self, source: Any, engines: Sequence[Any], version: int, items: list, wire: list, runs: list,
              layout: list[dict], rank: int, world: int, hold: Any, connect: list[float],
              reuse: bool) -> tuple[dict[str, float], bool]:
        """Open (or reuse the last sync's endpoints while the engines and layout are the same),
        write, commit; the metrics, and whether reused endpoints turned out stale (every rank
        returns the same)."""
        c0 = time.perf_counter()
        owners: list[int] = []  # engine index of each engine rank
        infos: list[dict] = []
        cached, error = False, None
        if rank == 0 and engines:
            try:
                if world > 1:
                    hold.wait()
                key = (tuple(W.members(engines)), tuple((d["name"], d["dtype"], tuple(d["shape"])) for d in layout))
                if reuse and self._opened is not None and self._opened[0] == key:
                    _, owners, infos = self._opened
                    cached = True
                else:
                    self._opened = None
                    for i, e in enumerate(engines):
                        for info in _open(e, layout, self.cfg.transport):
                            owners.append(i)
                            infos.append(info)
                    self._opened = (key, owners, infos)
            except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised
                error = e
        if world > 1:
            shared = source.broadcast_object(None if error else (infos, cached), src=0)
            if shared is None and error is None:  # every rank leaves here alike
                error = MilesError("p2p weight sync: trainer rank 0 could not open the engines")
            infos, cached = shared or ([], False)
        connect[0] += time.perf_counter() - c0
        if error is not None:
            raise error
        try:
            failed = self._write(items, wire, runs, infos, plan(len(runs), len(infos), world)[rank],
                                 hold.wait if hold is not None else None)
        except Exception as e:  # noqa: BLE001 - the other ranks still exchange their failures
            failed = [(-1, f"p2p weight sync on trainer rank {rank} failed: {type(e).__name__}: {e}")]
        if world > 1:  # every rank's failed writes, on every rank
            failed = [f for r in range(world) for f in source.broadcast_object(failed, src=r)]
        if failed and cached:
            self._opened = None
            return {}, True
        result, moved = self._commit(engines, infos, owners, failed, version) if rank == 0 else ({}, False)
        if world > 1:
            moved = source.broadcast_object(moved, src=0)
        if moved:
            self._opened = None
            if cached:
                return {}, True
            result = {"weight_sync_failed": 1.0}
        return result, False

    def _pause(self, engines: Sequence[Any]) -> list[Any]:
        """Hold generation while bytes land in the engines' parameters (in place: the batch in
        flight ends first); the engines paused, to continue afterwards."""
        if not self.cfg.pause:
            return []
        from miles.protocols import Pausable

        paused = []
        for e in engines:
            if isinstance(e, Pausable):
                e.pause_generation(mode="in_place")
                paused.append(e)
        return paused

    def _commit(self, engines: Sequence[Any], infos: list[dict], owners: list[int],
                failed: list[tuple[int, str]], version: int) -> tuple[dict[str, float], bool]:
        """Commit the version on every engine rank whose writes all went in; a failure with no
        engine server down is raised (naming the engine and bucket). Also says whether an engine
        found its parameters moved since it published them (the bytes went to their old memory)."""
        if failed:
            down = W.servers_down(engines)
            if not down:
                raise MilesError(failed[0][1])
            print(f"miles p2p: weight version {version} did not reach engine server(s) {', '.join(down)} "
                  f"(down: {failed[0][1]}); it is redone once they are back", file=sys.stderr)
        bad, moved = {j for j, _ in failed}, False
        for i, e in enumerate(engines):
            sessions = [info["session"] for j, info in enumerate(infos) if owners[j] == i and j not in bad]
            try:
                got = e.p2p_commit(weight_version=version, sessions=sessions)
            except Exception:
                if not W.servers_down([e]):
                    raise
                failed = failed or [(-1, "commit failed")]  # its server went down meanwhile
                continue
            answers = [got] if isinstance(got, dict) else list(got or [])
            moved = moved or any(isinstance(a, dict) and a.get("moved") for a in answers)
        return ({"weight_sync_failed": 1.0} if failed else {}), moved

    # -- writes ----------------------------------------------------------------------------------
    def _write(self, items: list, wire: list, runs: list[tuple[int, int]], infos: list[dict],
               mine: list[tuple[int, int]], gate: Any = None) -> list[tuple[int, str]]:
        """Write this rank's ``(bucket, engine rank)`` share; ``(engine rank, message)`` of each
        write that failed. Buckets are packed on this thread into a free send buffer while up to
        ``workers`` earlier ones are on the wire; ``gate()`` is called before the first write."""
        if not mine:
            return []
        import torch

        targets: dict[int, list[int]] = {}
        for b, j in mine:
            targets.setdefault(b, []).append(j)
        self._ensure()
        direct = self._sources([t for _, t in items], wire)
        layouts = {} if direct is not None else {  # send-buffer offsets, for packing only
            b: W.layout([wire[i] for i in range(*runs[b])], [items[i][1].shape for i in range(*runs[b])])
            for b in targets}
        if direct is None:
            self._ensure_buffers(max(size for _, size in layouts.values()))
        names, failed = {}, []
        for j in sorted({j for _, j in mine}):
            try:
                names[j] = self._connect(infos[j])
            except Exception as e:  # noqa: BLE001 - e.g. its server is gone: reported, others go on
                failed.append((j, f"p2p weight sync: connecting to engine {infos[j].get('url', j)} failed: "
                                  f"{type(e).__name__}: {e}"))
        targets = {b: [j for j in ranks if j in names] for b, ranks in targets.items()}
        targets = {b: ranks for b, ranks in targets.items() if ranks}
        if not targets:
            return failed
        free: queue.Queue = queue.Queue()
        for slot in range(len(self._bufs)):
            free.put(slot)
        jobs = []
        with torch.no_grad():
            for b, ranks in targets.items():
                s, e = runs[b]
                if direct is not None:
                    jobs.append(self._pool.submit(self._xfer, b, items[s][0], direct[s:e], s, ranks, infos, names))
                    continue
                slot = free.get()
                offsets, size = layouts[b]
                views = W.views(self._bufs[slot], wire[s:e], [items[i][1].shape for i in range(s, e)], offsets)
                torch._foreach_copy_(views, [items[i][1].detach() for i in range(s, e)])
                local = [(self._bufs[slot].data_ptr() + off, W.nbytes(v), 0) for off, v in zip(offsets, views)]
                if gate is not None:
                    gate()
                    gate = None
                jobs.append(self._pool.submit(self._xfer, b, items[s][0], local, s, ranks, infos, names, free, slot))
        for job in jobs:
            failed += job.result()
        self._keep_sources()
        return failed

    def _xfer(self, bucket: int, first: str, local: list, start: int, ranks: list[int], infos: list[dict],
              names: dict[int, str], free: queue.Queue | None = None, slot: int = 0) -> list[tuple[int, str]]:
        """One bucket into each of ``ranks``, all transfers posted before any wait; the send
        buffer (if any: ``free``) is free again once every one is done or failed."""
        agent, failed, handles = self._agent, [], []
        try:
            for j in ranks:
                where = f"bucket {bucket} ({first} ...) to engine {infos[j].get('url', j)}"
                try:
                    remote = [tuple(int(x) for x in t) for t in infos[j]["targets"][start:start + len(local)]]
                    wrong = next((k for k, (a, b) in enumerate(zip(local, remote)) if a[1] != b[1]), None)
                    if wrong is not None:
                        raise MilesError(f"the engine expects {remote[wrong][1]} bytes for tensor "
                                         f"{start + wrong} of the layout, the trainer sends {local[wrong][1]}")
                    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                              agent.get_xfer_descs(remote, infos[j].get("mem_type", "DRAM")),
                                              names[j])
                    if agent.transfer(h) == "ERR":
                        agent.release_xfer_handle(h)
                        raise MilesError("the transfer could not be posted")
                    handles.append((j, where, h))
                except Exception as e:  # noqa: BLE001 - reported with the engine and bucket
                    failed.append((j, f"p2p weight sync: {where} failed: {type(e).__name__}: {e}"))
            deadline = time.monotonic() + self.cfg.timeout_s
            for j, where, h in handles:
                state = _wait(agent, h, deadline)
                agent.release_xfer_handle(h)
                if state != "DONE":
                    failed.append((j, f"p2p weight sync: {where} failed: transfer state {state} "
                                      f"(transport.timeout_s={self.cfg.timeout_s:g})"))
        finally:
            if free is not None:
                free.put(slot)
        return failed

    def _ensure(self) -> None:
        """This process's agent and thread pool."""
        if self._agent is None:
            self._agent = make_agent(f"miles-trainer-{os.getpid()}-{secrets.token_hex(4)}", self.cfg.transport)
            self._pool = ThreadPoolExecutor(self.cfg.workers, thread_name_prefix="miles-p2p")

    def _sources(self, tensors: list, wire: list) -> list[tuple[int, int, int]] | None:
        """Source descriptors ``(address, bytes, 0)`` of the tensors as they lie, their memory
        registered with the agent, when every one is a contiguous CPU tensor sent in its own dtype
        (no packing: a copy of the model per sync saved); else None.

        A registration is kept only for tensors seen at the same addresses in two syncs in a row
        (a trainer's own parameters), holding references so the memory cannot be freed and reused
        while registered; tensors made afresh for each sync are registered for that sync alone."""
        if not all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == d for t, d in zip(tensors, wire)):
            return None
        key = tuple((t.data_ptr(), W.nbytes(t)) for t in tensors)
        if self._src is None or self._src[0] != key:
            self._release_sources()
            regions: dict[int, int] = {}  # storage address -> bytes: tied weights share one storage
            for t in tensors:
                if W.nbytes(t):
                    st = t.untyped_storage()
                    regions[st.data_ptr()] = st.nbytes()
            reg = self._agent.register_memory([(a, n, 0, "") for a, n in regions.items()], "DRAM")
            self._src = (key, reg, tensors)
        return [(a, n, 0) for a, n in key]

    def _keep_sources(self) -> None:
        """After a sync's writes: keep the direct sources' registration for the next sync only if
        they were the last sync's too."""
        if self._src is None:
            return
        stable, self._src_last = self._src[0] == self._src_last, self._src[0]
        if not stable:
            self._release_sources()

    def _release_sources(self) -> None:
        if self._src is not None:
            self._agent.deregister_memory(self._src[1])
            self._src = None

    def _ensure_buffers(self, size: int) -> None:
        """Registered send buffers of at least ``size`` bytes, one per write in flight."""
        import torch

        if self._bufs and self._bufs[0].numel() >= size:
            return
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
        self._bufs = [torch.empty(W.align(max(size, 1)), dtype=torch.uint8) for _ in range(self.cfg.workers)]
        self._reg = self._agent.register_memory(self._bufs)

    def _connect(self, info: dict) -> str:
        """The engine rank's agent, added (again when its metadata changed: a restarted engine)."""
        name, meta = info["agent"], info["metadata"]
        if self._remotes.get(name) != meta:
            if name in self._remotes:
                self._agent.remove_remote_agent(name)
            self._agent.add_remote_agent(base64.b64decode(meta))
            self._remotes[name] = meta
        return name

    def _wire_dtype(self, t: Any) -> Any:
        return W.to_dtype(self.cfg.dtype) if self.cfg.dtype and t.is_floating_point() else t.dtype

    def close(self) -> None:
        if self._agent is not None:
            self._release_sources()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


class _Hold:
    """Generation paused on the engines while weights land in them, asked on a thread of its own
    (``wait()`` before the first write)."""

    def __init__(self, transport: P2PTransport, engines: Sequence[Any]):
        self._calls = W.Calls([lambda: transport._pause(engines)])
        self._timeout = transport.cfg.timeout_s

    def wait(self) -> list[Any]:
        return self._calls.join(self._timeout)[0] or []

    def release(self) -> None:
        """Generation goes on (on the engines the pause reached)."""
        try:
            paused = self.wait()
        except Exception:  # noqa: BLE001 - the pause failed: nothing to continue
            return
        for e in paused:
            e.continue_generation()


def _open(engine: Any, layout: list[dict], transport: str) -> list[dict]:
    """The engine's transfer endpoints, one per engine rank (a client of several servers: one per
    server)."""
    if not isinstance(engine, ReceivesP2P):
        raise MilesError(f"transport.name=p2p: engine {type(engine).__name__} publishes no transfer endpoint "
                         "(p2p_open); use `miles serve` workers (launcher.engines>=1, engine.name=sglang), "
                         "or transport.name=tensor for an in-process engine")
    got = engine.p2p_open(tensors=layout, transport=transport)
    return [got] if isinstance(got, dict) else list(got)


def _wait(agent: Any, handle: Any, deadline: float) -> str:
    """Poll a transfer until it is done or failed (short sleeps: the progress thread moves it)."""
    while True:
        state = agent.check_xfer_state(handle)
        if state != "PROC" or time.monotonic() > deadline:
            return state
        time.sleep(2e-4)  # spinning threads would take the CPU the transfer itself needs


def _rank_world(source: Any) -> tuple[int, int]:
    from miles.protocols import Distributed

    if isinstance(source, Distributed) and int(source.world_size or 1) > 1:
        return int(source.rank), int(source.world_size)
    return 0, 1
