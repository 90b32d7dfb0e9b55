"""Receiving side of weight sync: SGLang's weight-update methods on the torch engine.

Mixed into ``TorchEngine``; ``miles serve`` exposes these methods under SGLang's endpoint names,
so one transport drives an in-process engine, a ``miles serve`` process or an SGLang server alike.
Byte layouts, checksums and the disk format come from ``miles_wire`` (shared with the
transports); this module never imports a transport plugin.

Formats of ``update_weights_from_tensor`` (trainer and engine on one host):

* ``{"format": "miles-shm/1", "segment": NAME, "size": BYTES, "adopt": bool, "tensors":
  [{"name", "dtype", "shape", "offset"}, ...]}``: the bucket's bytes sit in the POSIX shared
  memory segment ``NAME``. With ``adopt`` the engine's CPU parameters of the same dtype become
  views of the segment (no copy at all; the trainer writes the next version into a second
  segment, so these views stay valid until the version after); otherwise bytes are copied in.
* ``{"format": "miles-cuda-ipc/1", "handle": H, "size": BYTES, "tensors": [{"name", "dtype",
  "shape", "offset"}, ...]}``: ``H`` is a base64 pickle of
  ``torch.multiprocessing.reductions.reduce_tensor(buf)`` for the trainer's uint8 GPU buffer
  holding the bucket; tensors are copied out of it into the parameters, and the engine
  synchronises before returning (the trainer may then reuse the buffer). Unpickling is
  restricted to the classes that payload contains.
* ``{"format": "miles-cuda-ipc/1", "handles": [H, ...], "tensors": [{"name", "dtype", "shape",
  "handle", "offset"}, ...]}``: the trainer's own storages, tensor ``i`` at byte ``offset`` of
  ``handles[handle]``. The trainer sends the same handles at every sync while its weights stay
  in place; the engine opens each once and copies straight out of the trainer's parameters.
"""
from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import pickle
import re
from collections import Counter
from typing import Any, Iterable, Sequence

import miles_wire as W
import torch
from miles import MilesError

SHM_FORMAT, CUDA_IPC_FORMAT = W.SHM_FORMAT, W.CUDA_IPC_FORMAT
GROUP_TIMEOUT_S = 600.0
_SEGMENT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")


class _State:
    def __init__(self):
        self.groups: dict[str, tuple[Any, Any, str]] = {}  # name -> (group, store, backend)
        self.segments: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (mapping, last epoch)
        self.adopted: set[int] = set()  # ids of tensors whose storage is a trainer's segment
        self.recv: torch.Tensor | None = None  # reused receive buffer of packed broadcasts
        self.homes: dict[tuple, torch.Tensor] = {}  # packed bucket's names -> buffer its params live in
        self.plans: dict[tuple, Any] = {}  # a bucket's (names, dtypes, shapes, pack_below) -> its plan
        self.steady: dict[tuple, tuple] = {}  # same key -> (buffer, [(param, data_ptr)], copy views)
        self.ipc: dict[str, tuple[torch.Tensor, int]] = {}  # CUDA IPC handle -> (storage, last epoch)
        self.epoch = 0  # bumped whenever a tensor payload brings a new weight version
        self.last_version: Any = None


class WeightReceiver:
    """SGLang's weight-update API over ``self._targets`` (name -> parameter or buffer)."""

    remote = False  # in process: transports may hand tensors over by reference (load_weights)
    # update_weights_from_distributed takes a whole sync's buckets in one call (``buckets``):
    # the broadcast transport then announces a sync once instead of once per bucket
    accepts_buckets = True
    _max_payload: int | None = None  # bytes a shared-memory payload may claim (set on first use)

    @property
    def _ws(self) -> _State:
        st = self.__dict__.get("_ws_state")
        if st is None:
            st = self.__dict__["_ws_state"] = _State()
        return st

    def _target(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        dst = self._targets.get(name)
        if dst is None:
            raise MilesError(f"torch engine: the model has no parameter or buffer named {name!r}")
        if tuple(dst.shape) != tuple(int(d) for d in shape):
            raise MilesError(f"torch engine: {name!r} has shape {tuple(dst.shape)}, got {tuple(shape)}")
        return dst

    @torch.no_grad()
    def _assign(self, name: str, src: torch.Tensor, adopt: bool = False) -> None:
        self._assign_all([(name, src)], adopt)

    @torch.no_grad()
    def _assign_all(self, pairs: Sequence[tuple[str, torch.Tensor]], adopt: bool = False) -> None:
        """Copy each ``(name, tensor)`` into its parameter, all in one ``_foreach_copy_`` (a few
        kernel launches per bucket on CUDA, not one per tensor); with ``adopt``, parameters of the
        same dtype and device become the given tensors instead (no copy). Every valid pair is
        applied before the first bad name is raised."""
        ws, errors = self._ws, []
        dsts, srcs = [], []
        if getattr(self, "_fp8", None) is not None:  # FP8 linear weights are quantized, not copied
            pairs = self._fp8.divert(pairs)
        for name, src in pairs:
            try:
                dst = self._target(name, src.shape)
            except MilesError as e:
                errors.append(e)
                continue
            if adopt and src.dtype == dst.dtype and src.device == dst.device:
                dst.data = src  # tied names share one Parameter, so both follow
                ws.adopted.add(id(dst))
                continue
            if id(dst) in ws.adopted:
                # its storage is a trainer segment other engines may map too: never write into it
                dst.data = torch.empty_like(dst)
                ws.adopted.discard(id(dst))
            dsts.append(dst.data)
            srcs.append(src)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        if errors:
            raise errors[0]

    def _set_version(self, weight_version: Any) -> None:
        if weight_version is not None:
            self.weight_version = int(weight_version)

    # -- disk ------------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: Any = None,
                                 load_format: str | None = None) -> None:
        """Load a version written by the ``disk`` transport (``model_path`` holds its LATEST and
        version folders): ``weight_version``'s newest revision, or the newest version."""
        if load_format not in (None, "auto", "safetensors"):
            raise MilesError(f"torch engine: update_weights_from_disk cannot read load_format {load_format!r}")
        version = int(weight_version) if weight_version is not None else None
        _check_shards(model_path, W.read_manifest(model_path, version))
        for name, t in W.load_version(model_path, version):
            self._assign(name, t)
        self._set_version(version if version is not None else W.read_manifest(model_path)["version"])

    # -- checksums -------------------------------------------------------------------------------
    def weight_checksums(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """blake2b-128 of each named tensor's bytes (``None``: every tensor of the model's state
        dict, i.e. what a trainer sends; non-persistent buffers such as RoPE tables are left out)."""
        names = list(self.model.state_dict()) if names is None else list(names)
        missing = [n for n in names if n not in self._targets]
        if missing:
            raise MilesError(f"torch engine: no parameter or buffer named {missing[0]!r}")
        return {n: W.checksum(self._targets[n]) for n in names}

    # -- torch.distributed broadcast --------------------------------------------------------------
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str = "gloo",
                                  timeout_s: float = GROUP_TIMEOUT_S) -> None:
        """Join group ``group_name`` as rank ``rank_offset`` (the trainer is rank 0); blocks until
        every rank has joined (at most ``timeout_s``). A group of the same name is replaced."""
        if backend == "nccl" and self.device.type != "cuda":
            raise MilesError("torch engine: backend 'nccl' needs engine.device=cuda (use 'gloo')")
        self.destroy_weights_update_group(group_name, missing_ok=True)
        store = W.open_store(master_address, master_port, world_size, is_master=False,
                             timeout_s=float(timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(self._param_device())  # the communicator binds to this device
        group = W.new_group(store, rank_offset, world_size, group_name, backend, float(timeout_s))
        self._ws.groups[group_name] = (group, store, backend)

    def destroy_weights_update_group(self, group_name: str, missing_ok: bool = False) -> None:
        entry = self._ws.groups.pop(group_name, None)
        if entry is None:
            if missing_ok:
                return
            raise MilesError(f"torch engine: no weights update group named {group_name!r}")
        if hasattr(entry[0], "shutdown"):
            entry[0].shutdown()

    @torch.no_grad()
    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str,
                                        weight_version: Any = None, flush_cache: bool = True,
                                        load_format: str | None = None, pack_below: int = 0,
                                        buckets: Sequence[int] | None = None) -> None:
        """Receive one bucket broadcast by rank 0 of ``group_name`` or, with ``buckets`` (our
        extension; see ``accepts_buckets``), several: ``buckets[i]`` consecutive tensors of
        ``names`` per bucket, each bucket broadcast as if announced by a call of its own.

        Wire format (``miles_wire.wire_plan``): tensors under ``pack_below`` bytes arrive
        first, packed in one uint8 buffer; every other tensor follows in its own broadcast, in
        order, straight into its parameter when dtype, shape and device allow. ``pack_below=0``
        is SGLang's format (one broadcast per tensor). Every broadcast is received before any
        error is raised, so a bad name never leaves the trainer waiting.
        """
        if group_name not in self._ws.groups:
            raise MilesError(f"torch engine: no weights update group named {group_name!r}; "
                             "call init_weights_update_group first")
        counts = [len(names)] if buckets is None else [int(c) for c in buckets]
        if sum(counts) != len(names) or min(counts, default=1) < 1:
            raise MilesError(f"torch engine: buckets {counts} do not split the {len(names)} names "
                             "into non-empty runs")
        group, _, backend = self._ws.groups[group_name]
        dev = self._param_device() if backend == "nccl" else torch.device("cpu")
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            # NCCL works on the calling thread's current device
            a, failed = 0, None
            for c in counts:  # every bucket is received, even after one failed (see above)
                try:
                    self._receive(group, dev, names[a:a + c], dtypes[a:a + c], shapes[a:a + c], int(pack_below))
                except MilesError as e:
                    failed = failed or e
                a += c
        if failed is not None:
            raise failed
        self._set_version(weight_version)

    def _receive(self, group, dev, names, dtypes, shapes, pack_below: int) -> None:
        # every sync sends the same buckets: their plans (and, below, their receive views) are
        # kept, so a steady-state bucket costs no per-tensor Python work
        key = (tuple(names), tuple(dtypes), tuple(map(tuple, shapes)), pack_below)
        plan = self._ws.plans.get(key)
        if plan is None:
            plan = self._ws.plans[key] = W.wire_plan(dtypes, shapes, pack_below)
        into: list[torch.Tensor] = []  # receive buffers in wire order, all posted at once
        staged: list[tuple[str, torch.Tensor]] = []  # (name, tensor) to copy in once received
        home: list[tuple[str, torch.Tensor]] = []  # (name, view) to re-point at a new home
        if plan.packed:
            steady = self._ws.steady.get(key)
            if steady is not None and all(p.data_ptr() == ptr for p, ptr in steady[1]):
                buf, copy = steady[0], steady[2]
            else:
                steady = None
                packed = [names[i] for i in plan.packed]
                buf, home, copy = self._packed_into(packed, [dtypes[i] for i in plan.packed],
                                                    [shapes[i] for i in plan.packed], plan, dev)
            into.append(buf)
            staged += copy
        for i in plan.direct:
            dtype, shape = W.to_dtype(dtypes[i]), tuple(int(d) for d in shapes[i])
            dst = self._targets.get(names[i])
            if (dst is not None and dst.dtype == dtype and tuple(dst.shape) == shape and dst.device == dev
                    and dst.is_contiguous() and id(dst) not in self._ws.adopted):
                into.append(dst.data)  # received in place: no copy
                continue
            tmp = torch.empty(shape, dtype=dtype, device=dev)
            into.append(tmp)
            staged.append((names[i], tmp))
        W.broadcast_all(group, into)
        for name, view in home:
            self._targets[name].data = view
        if plan.packed and steady is None:
            live = [*self._ws.homes.values(), self._ws.recv]  # entries of dropped homes go
            self._ws.steady = {k: v for k, v in self._ws.steady.items() if any(v[0] is b for b in live)}
            self._ws.steady[key] = (buf, self._living_in(packed, buf), copy)
        self._assign_all(staged)

    def _packed_into(self, names: list[str], dtypes: list, shapes: list, plan: W.WirePlan,
                     dev: torch.device) -> tuple[torch.Tensor, list, list]:
        """Where a packed bucket is received: ``(buffer, home, copy)``. Parameters whose dtype,
        shape and device match the wire live in a buffer of their bucket's layout from their first
        sync on: later syncs of that layout are received straight into them (no copy at all).
        ``home`` lists ``(name, view)`` of parameters to re-point into a new such buffer once the
        bytes are in; ``copy`` those copied out afterwards (other dtypes, tied names, unknown names:
        the copy reports them)."""
        ws = self._ws
        aliases = Counter(id(t) for t in self._targets.values())  # tied names share a Parameter
        dsts = [self._targets.get(n) for n in names]
        ok = [d is not None and d.dtype == W.to_dtype(t) and tuple(d.shape) == tuple(int(x) for x in s)
              and d.device == dev and d.numel() > 0 and id(d) not in ws.adopted and aliases[id(d)] == 1
              for d, t, s in zip(dsts, dtypes, shapes)]
        if not any(ok):
            buf = self._recv_buffer(plan.packed_bytes, dev)
            return buf, [], list(zip(names, W.views(buf, dtypes, shapes, plan.offsets)))
        key = tuple(names)
        buf = ws.homes.get(key)
        fresh = buf is None or buf.numel() != plan.packed_bytes or not all(
            d.data_ptr() == buf.data_ptr() + off for d, off, good in zip(dsts, plan.offsets, ok) if good)
        if fresh:  # a new home; homes of other layouts holding any of these names are dropped
            ws.homes = {k: b for k, b in ws.homes.items() if not set(k) & set(names)}
            buf = ws.homes[key] = torch.empty(plan.packed_bytes, dtype=torch.uint8, device=dev)
        got = list(zip(names, W.views(buf, dtypes, shapes, plan.offsets)))
        home = [g for g, good in zip(got, ok) if good and fresh]
        return buf, home, [g for g, good in zip(got, ok) if not good]

    def _living_in(self, names: list[str], buf: torch.Tensor) -> list[tuple[Any, int]]:
        """``(parameter, data_ptr)`` of the parameters among ``names`` that live in ``buf``:
        while none has moved, the bucket's receive views (into ``buf``) stay valid."""
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
        params = [self._targets[n] for n in names if n in self._targets]
        return [(p, p.data_ptr()) for p in params if lo <= p.data_ptr() < hi]

    def _param_device(self) -> torch.device:
        """The parameters' device with its index ("cuda:0", where the config may say "cuda")."""
        return next(iter(self._targets.values())).device

    def _recv_buffer(self, size: int, device: torch.device) -> torch.Tensor:
        buf = self._ws.recv
        if buf is None or buf.numel() < size or buf.device != device:
            buf = self._ws.recv = torch.empty(size, dtype=torch.uint8, device=device)
        return buf[:size]

    # -- colocated hand-off ------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights_from_tensor(self, serialized_named_tensors: Any, load_format: str | None = None,
                                   weight_version: Any = None, flush_cache: bool = True) -> None:
        """Load one bucket described by ``serialized_named_tensors`` (see the module docstring;
        a JSON string, a dict, or SGLang's one-entry-per-TP-rank list of either)."""
        desc = serialized_named_tensors
        if isinstance(desc, (list, tuple)):
            if len(desc) != 1:
                raise MilesError(f"torch engine: got {len(desc)} tensor payloads, one per TP rank; "
                                 "this engine has a single rank")
            desc = desc[0]
        if isinstance(desc, (str, bytes)):
            desc = json.loads(desc)
        fmt = desc.get("format") if isinstance(desc, dict) else None
        ws = self._ws
        if weight_version is None or weight_version != ws.last_version:
            ws.epoch += 1  # mappings and handles unused for a while are dropped by epoch
            ws.last_version = weight_version
        if fmt == SHM_FORMAT:
            self._from_segment(desc)
        elif fmt == CUDA_IPC_FORMAT:
            self._from_cuda(desc)
        else:
            raise MilesError(f"torch engine: unknown tensor payload format {fmt!r} "
                             f"(expected {SHM_FORMAT!r} or {CUDA_IPC_FORMAT!r})")
        self._set_version(weight_version)

    def _from_segment(self, desc: dict) -> None:
        buf = self._segment(desc["segment"], int(desc["size"]))
        entries = desc["tensors"]
        got = W.views(buf, [e["dtype"] for e in entries], [e["shape"] for e in entries],
                      [int(e["offset"]) for e in entries])
        adopt = bool(desc.get("adopt")) and self.device.type == "cpu"
        self._assign_all([(e["name"], t) for e, t in zip(entries, got)], adopt=adopt)

    def _from_cuda(self, desc: dict) -> None:
        entries = desc["tensors"]
        if "handles" in desc:  # the trainer's own storages, each opened once and kept
            bufs = self._ipc_storages(desc["handles"])
            got = [W.views(bufs[int(e["handle"])], [e["dtype"]], [e["shape"]], [int(e["offset"])])[0]
                   for e in entries]
        else:
            bufs = [_rebuild_cuda(desc["handle"])[:int(desc["size"])]]
            got = W.views(bufs[0], [e["dtype"] for e in entries], [e["shape"] for e in entries],
                          [int(e["offset"]) for e in entries])
        try:
            self._assign_all([(e["name"], t) for e, t in zip(entries, got)])
        finally:
            # the copies must be done before the trainer changes, reuses or frees that memory
            for dev in {b.device for b in bufs} | {self._param_device()}:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

    def _ipc_storages(self, handles: list[str]) -> list[torch.Tensor]:
        """Trainer storages by their CUDA IPC handles, each opened once (opening one costs far
        more than copying out of it); one no payload named for two weight versions is dropped."""
        ws = self._ws
        for h in handles:
            have = ws.ipc.get(h)
            ws.ipc[h] = (have[0] if have is not None else _rebuild_cuda(h), ws.epoch)
        ws.ipc = {h: e for h, e in ws.ipc.items() if e[1] >= ws.epoch - 1}
        return [ws.ipc[h][0] for h in handles]

    def _segment(self, name: str, size: int) -> torch.Tensor:
        """The trainer's segment, mapped once and kept: a fresh mapping costs a page fault per
        page. The trainer alternates two segments per bucket, so a mapping unused for three
        versions is dropped (adopted parameters keep their own mapping alive regardless)."""
        ws = self._ws
        if not _SEGMENT_NAME.match(name):
            raise MilesError(f"torch engine: invalid shared memory segment name {name!r}")
        if self._max_payload is None:  # a bucket never holds more than every weight, even as float64
            self._max_payload = 8 * sum(t.numel() for t in self._targets.values()) + (1 << 20)
        if not 0 < size <= self._max_payload:
            raise MilesError(f"torch engine: shared memory payload of {size} bytes; this model's "
                             f"weights fit in {self._max_payload} bytes")
        have = ws.segments.get(name)
        if have is None or have[0].numel() < size:
            have = (_map_segment(name, size), ws.epoch)
        ws.segments[name] = (have[0], ws.epoch)
        for old in [n for n, (_, used) in ws.segments.items() if used < ws.epoch - 2]:
            del ws.segments[old]
        return have[0][:size]


def _check_shards(root: str, manifest: dict) -> None:
    """Every shard of a disk update is a ``.safetensors`` file inside ``root``: pickled formats
    (``.bin``, ``.pt``) can run code when loaded, and are never read."""
    real_root = os.path.realpath(root)
    for name, entry in manifest.get("tensors", {}).items():
        file = str(entry.get("file", ""))
        path = os.path.realpath(os.path.join(real_root, file))
        if not file.endswith(".safetensors") or not path.startswith(real_root + os.sep):
            raise MilesError(f"torch engine: {name!r} is stored in {file!r}; only .safetensors files "
                             f"inside {root} are loaded (never pickled .bin/.pt weights)")


def _map_segment(name: str, size: int) -> torch.Tensor:
    """A uint8 tensor over POSIX shared memory segment ``name`` (mapped shared, not copied)."""
    path = os.path.join("/dev/shm", name)
    if os.path.exists(path):
        if size > os.path.getsize(path):  # mapping past its end would grow the trainer's file
            raise MilesError(f"torch engine: shared memory segment {name!r} holds "
                             f"{os.path.getsize(path)} bytes, the payload claims {size}")
        # torch owns the mapping: no resource tracker that would unlink the trainer's segment
        # at our exit, and no exported-buffer errors while parameters still view it
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    from multiprocessing import resource_tracker, shared_memory

    try:
        shm = shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")  # the trainer owns it
    except FileNotFoundError as e:
        raise MilesError(f"torch engine: no shared memory segment {name!r} on this host (the "
                         "tensor transport needs the engine on the trainer's machine)") from e
    t = torch.frombuffer(shm.buf, dtype=torch.uint8, count=size)
    t._miles_shm = shm  # keep the mapping open as long as the tensor lives
    return t


class _CudaUnpickler(pickle.Unpickler):
    """Only what ``reduce_tensor`` of a CUDA tensor pickles: its rebuild function, torch classes
    and dtypes. Anything else in a payload is refused rather than imported."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return super().find_class(module, name)
        if module in ("torch", "torch.storage", "torch.nn.parameter") and (
                name in {"Tensor", "UntypedStorage", "TypedStorage", "Parameter", "device", "Size"}
                or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise MilesError(f"torch engine: refusing {module}.{name} in a CUDA IPC payload")


def _rebuild_cuda(handle: str) -> torch.Tensor:
    fn, args = _CudaUnpickler(io.BytesIO(base64.b64decode(handle))).load()
    return fn(*args)
