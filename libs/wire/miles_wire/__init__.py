"""miles-wire: the weight-sync wire library shared by the transports (trainer side) and the
engines (receiving side).

Both ends of a transport must agree on byte layouts, checksums and the on-disk format without
importing each other's plugin, so those pieces live here, once (a library, not a plugin: it
registers nothing). torch (and safetensors) are imported inside the functions: importing this
module stays free.

* names and bytes: ``dtype_name``/``to_dtype`` (dtype strings without ``torch.``, as SGLang
  sends them), ``nbytes``, ``checksum`` (blake2b-128 of the raw bytes: exact for every dtype);
* bucketing: ``buckets`` cuts a ``(name, tensor)`` stream into lists of at most N bytes;
* packing: ``layout``/``pack``/``views`` place tensors of any dtypes in one uint8 buffer at
  ``ALIGN``-byte offsets (both ends compute the offsets from dtypes and shapes alone);
  ``wire_plan`` says which tensors of a broadcast bucket travel packed and which on their own;
* calls to engines: ``Calls``/``parallel`` run them concurrently on daemon threads (a push in
  the background is one ``Calls``); ``is_sender``: the trainer rank that talks to engines;
* verification: ``engine_checksums`` + ``expect_same`` (raise ``MilesError`` naming the first
  tensor that differs);
* process groups: ``open_store``/``new_group``/``broadcast_all`` build a group of their own (a TCP
  store + a gloo or NCCL group object) that never touches the default group, so a multi-rank
  trainer and a one-process engine can join it alike;
* the ``disk`` transport's folder format: ``read_manifest``/``load_version``;
* ``miles_wire.llama``: the Llama-family layout check of the engine's and trainer's fast paths;
* ``miles_wire.cpu_gemm``: those fast paths' CPU GEMM library (MKL or oneDNN) and its choice;
* ``miles_wire.testing``: ``EngineProcess``, an engine in a child process (the test double of a
  remote engine for transport tests).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from miles.errors import MilesError

if TYPE_CHECKING:  # pragma: no cover
    import torch

# payload formats of engine.update_weights_from_tensor (described in the torch engine's weights.py)
SHM_FORMAT = "miles-shm/1"
CUDA_IPC_FORMAT = "miles-cuda-ipc/1"
# 64 bytes: any dtype view of a packed slot is aligned (and cache-line aligned for the copy)
ALIGN = 64


# -- names, bytes, checksums ---------------------------------------------------------------------
def dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> "torch.dtype":
    import torch

    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise MilesError(f"weight sync: unknown dtype {name!r} (expected a torch dtype name such as "
                         "'float32' or 'bfloat16')")
    return dtype


def nbytes(t: "torch.Tensor") -> int:
    return t.numel() * t.element_size()


def checksum(t: "torch.Tensor") -> str:
    """blake2b-128 of a tensor's raw bytes (any dtype, any device; bit-exact comparison)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return hashlib.blake2b(flat.contiguous().view(_uint8()).numpy(), digest_size=16).hexdigest()


def _uint8():
    import torch

    return torch.uint8


# -- bucketing and packing -----------------------------------------------------------------------
def buckets(named: Iterable[tuple[str, "torch.Tensor"]], limit: int,
            first: int | None = None) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    """Consecutive groups of at most ``limit`` bytes (``first`` for the first group; a larger
    tensor forms a group of its own)."""
    group: list[tuple[str, Any]] = []
    size, cap = 0, limit if first is None else first
    for name, t in named:
        n = nbytes(t)
        if group and size + n > cap:
            yield group
            group, size, cap = [], 0, limit
        group.append((name, t))
        size += n
    if group:
        yield group


def timed(named: Iterable[tuple[str, "torch.Tensor"]], spent: list[float]) -> Iterator[tuple[str, Any]]:
    """``named``, adding to ``spent[0]`` the seconds spent producing its tensors (e.g. gathering
    FSDP shards). CUDA work is queued, not done: see ``ready``."""
    import time

    it = iter(named)
    while True:
        t0 = time.perf_counter()
        item = next(it, None)
        spent[0] += time.perf_counter() - t0
        if item is None:
            return
        yield item


def ready(bucket: Sequence[tuple[str, "torch.Tensor"]], spent: list[float]) -> None:
    """Wait until the CUDA kernels producing ``bucket``'s tensors are done, adding the wait to
    ``spent[0]`` (with ``timed``: the full cost of producing the bucket)."""
    import time

    if bucket and bucket[0][1].is_cuda:
        import torch

        t0 = time.perf_counter()
        torch.cuda.current_stream(bucket[0][1].device).synchronize()
        spent[0] += time.perf_counter() - t0


def align(n: int) -> int:
    """``n`` rounded up to ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(dtypes: Sequence[Any], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a packed buffer, and the buffer's size."""
    offsets, end = [], 0
    for dtype, shape in zip(dtypes, shapes):
        dtype = to_dtype(dtype) if isinstance(dtype, str) else dtype
        offsets.append(end)
        end = align(end + _numel(shape) * dtype.itemsize)
    return offsets, end


def views(buf: "torch.Tensor", dtypes: Sequence[Any], shapes: Sequence[Sequence[int]],
          offsets: Sequence[int]) -> list["torch.Tensor"]:
    """Typed views of a uint8 ``buf`` at ``offsets`` (no copy)."""
    out = []
    for dtype, shape, off in zip(dtypes, shapes, offsets):
        dtype = to_dtype(dtype) if isinstance(dtype, str) else dtype
        out.append(buf[off:off + _numel(shape) * dtype.itemsize].view(dtype).view(tuple(int(d) for d in shape)))
    return out


def pack(tensors: Sequence["torch.Tensor"], offsets: Sequence[int], buf: "torch.Tensor",
         dtypes: Sequence[Any] | None = None) -> None:
    """Copy ``tensors`` into the uint8 ``buf`` at ``offsets``, as ``dtypes`` (default: their own;
    any device pair copy_ handles)."""
    import torch

    slots = views(buf, dtypes or [t.dtype for t in tensors], [t.shape for t in tensors], offsets)
    torch._foreach_copy_(slots, list(tensors))  # few kernel launches for the whole bucket on CUDA


@dataclass
class WirePlan:
    """How one broadcast bucket travels: ``packed`` tensors (indices) share one uint8 buffer of
    ``packed_bytes`` at ``offsets``, sent first; each ``direct`` tensor is then sent on its own,
    straight from the trainer's tensor into the engine's parameter (no packing copies)."""

    packed: list[int]
    offsets: list[int]
    packed_bytes: int
    direct: list[int]


def wire_plan(dtypes: Sequence[Any], shapes: Sequence[Sequence[int]], pack_below: int) -> WirePlan:
    """Tensors under ``pack_below`` bytes are packed; the rest go direct. ``pack_below=0`` sends
    every tensor on its own, which is SGLang's own wire format for this call."""
    sizes = [(to_dtype(d) if isinstance(d, str) else d).itemsize * _numel(s)
             for d, s in zip(dtypes, shapes)]
    packed = [i for i, n in enumerate(sizes) if n < pack_below]
    direct = [i for i, n in enumerate(sizes) if n >= pack_below]
    offsets, total = layout([dtypes[i] for i in packed], [shapes[i] for i in packed])
    return WirePlan(packed, offsets, total, direct)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Calls:
    """Zero-argument calls running concurrently on daemon threads (remote engines block on a
    rendezvous or a transfer while this thread takes part in it). ``check()`` raises the first
    error as soon as there is one; ``join()`` waits for all and returns their results. Daemon
    threads: a call stuck on a dead peer never keeps the process from exiting."""

    def __init__(self, calls: Sequence[Any]):
        import threading

        self.results: list[Any] = [None] * len(calls)
        self._error: BaseException | None = None
        self._left = len(calls)
        self._done = threading.Condition()
        for i, call in enumerate(calls):
            threading.Thread(target=self._run, args=(i, call), daemon=True).start()

    def _run(self, i: int, call: Any) -> None:
        try:
            self.results[i] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised by check()/join()
            with self._done:
                self._error = self._error or e
        with self._done:
            self._left -= 1
            self._done.notify_all()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def join(self, timeout_s: float | None = None) -> list[Any]:
        with self._done:
            ok = self._done.wait_for(lambda: self._left == 0 or self._error is not None, timeout_s)
        self.check()
        if not ok:
            raise MilesError(f"weight sync: engines did not answer within {timeout_s:.0f} s")
        return self.results


def parallel(calls: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
    """Run ``calls`` concurrently (inline when there is one) and return their results."""
    if len(calls) == 1 and timeout_s is None:
        return [calls[0]()]
    return Calls(calls).join(timeout_s)


def is_sender(trainer: Any) -> bool:
    """Only trainer rank 0 talks to engines; other ranks just take part in ``named_weights()``."""
    return int(getattr(trainer, "rank", 0) or 0) == 0


def is_remote(engine: Any) -> bool:
    """True for an engine in another process (a client sets ``remote = True``; an object without
    ``load_weights`` cannot take tensors by reference either)."""
    return bool(getattr(engine, "remote", False)) or not hasattr(engine, "load_weights")


def verify(engines: Sequence[Any], want: dict[str, str], version: int) -> None:
    """Every engine holds ``version`` and tensors whose checksums are ``want``, else MilesError."""
    for i, engine in enumerate(engines):
        who = f"engine {i}" if len(engines) > 1 else "engine"
        have = getattr(engine, "weight_version", version)
        if have is not None and int(have) != int(version):
            raise MilesError(f"weight sync verification failed: {who} reports weight_version "
                             f"{have}, expected {version}")
        got = engine_checksums(engine, list(want))
        if got is not None:
            expect_same(want, got, who)


def engine_checksums(engine: Any, names: Sequence[str]) -> dict[str, str] | None:
    """``engine.weight_checksums(names)``, or checksums of ``engine.named_weights()`` for an
    in-process engine that only offers the latter. None: no part of the engine holds the
    version just pushed (its servers went down meanwhile; they are re-synced once back)."""
    if hasattr(engine, "weight_checksums"):
        got = engine.weight_checksums(list(names))
        return None if got is None else dict(got)
    if hasattr(engine, "named_weights"):
        wanted = set(names)
        return {n: checksum(t) for n, t in engine.named_weights() if n in wanted}
    raise MilesError(f"sync.verify needs an engine with weight_checksums() or named_weights(); "
                     f"{type(engine).__name__} has neither (set sync.verify=false)")


def expect_same(want: dict[str, str], got: dict[str, str], who: str = "engine") -> None:
    """Raise ``MilesError`` naming the first tensor (in ``want``'s order) whose checksum differs."""
    for name, digest in want.items():
        have = got.get(name)
        if have != digest:
            detail = "is missing" if have is None else f"has checksum {have}, the trainer's is {digest}"
            raise MilesError(f"weight sync verification failed: {who} tensor {name} {detail} (an "
                             "engine running another dtype than the trainer can never match: use "
                             "sync.verify=false there)")


# -- process groups of their own -----------------------------------------------------------------
def open_store(address: str, port: int, world_size: int, *, is_master: bool, timeout_s: float) -> Any:
    """A TCP rendezvous store; the master with ``port=0`` binds a free port (``store.port``)."""
    import torch.distributed as dist

    return dist.TCPStore(address, int(port), int(world_size), is_master=is_master,
                         wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def new_group(store: Any, rank: int, world_size: int, group_name: str, backend: str,
              timeout_s: float) -> Any:
    """A gloo or NCCL process group over ``store`` alone (keys prefixed by ``group_name``).

    Built from the backend's constructor rather than ``init_process_group``/``new_group``, which
    need the default group and every one of its ranks; blocks until all ``world_size`` ranks join.
    """
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise MilesError(f"weight sync: unknown backend {backend!r} (use 'gloo' or 'nccl')")
    prefixed = dist.PrefixStore(f"miles/{group_name}/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, int(rank), int(world_size), timedelta(seconds=timeout_s))
    if not dist.is_nccl_available():
        raise MilesError("weight sync: backend 'nccl' needs a CUDA build of torch")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(prefixed, int(rank), int(world_size), opts)


def broadcast(group: Any, t: "torch.Tensor", root: int = 0, check: Any = None) -> None:
    """Broadcast ``t``'s bytes from ``root`` (see ``broadcast_all``)."""
    broadcast_all(group, [t], root, check)


def broadcast_all(group: Any, tensors: Sequence["torch.Tensor"], root: int = 0, check: Any = None) -> None:
    """Broadcast each tensor's bytes from ``root``, in order, and wait for them (see ``post``)."""
    wait_all(post(group, tensors, root), check)


def post(group: Any, tensors: Sequence["torch.Tensor"], root: int = 0) -> list:
    """Queue a broadcast of each tensor's bytes from ``root`` (as uint8, so every dtype works on
    every backend), all before any wait: the backend runs them back to back, with no thread
    hand-off between messages on either side. Returns the works, for ``wait_all``."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    works = []
    for t in tensors:
        flat = t.reshape(-1)
        works.append((group.broadcast([flat if flat.dtype == _uint8() else flat.view(_uint8())], opts),
                      flat.is_cuda))
    return works


def wait_all(works: list, check: Any = None, host: bool = True) -> None:
    """Wait for ``post``'s works. ``check`` (trainer side) is called about once a second while the
    peers have not all joined, so that an engine whose call failed stops the wait at once instead
    of at the group timeout. ``host=False``: NCCL works only order the current CUDA stream after
    them (the host goes on at once); gloo works are waited for on the host either way."""
    for work, cuda in works:
        if cuda and not host:
            work.wait()
        else:
            _wait(work, cuda, check)


def _wait(work: Any, cuda: bool, check: Any) -> None:
    if check is None:
        work.wait()
    elif cuda:
        # NCCL's wait() only orders streams; the host learns of completion by polling
        import time

        while not work.is_completed():
            check()
            time.sleep(2e-5)
        work.wait()
    else:
        while True:
            try:
                work.wait(timedelta(seconds=1))
                return
            except RuntimeError as e:  # gloo: "Operation timed out!" leaves the work retryable
                if "timed out" not in str(e):
                    raise
                check()


# -- the disk transport's folder format ----------------------------------------------------------
LATEST = "LATEST"
MANIFEST = "manifest.json"
_FOLDER = re.compile(r"^v(\d{8})(?:\.r(\d+))?$")


def parse_folder(name: str) -> tuple[int, int] | None:
    """(version, rev) of a committed version folder name (``v00000007``, ``v00000007.r1``)."""
    m = _FOLDER.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def committed(root: str) -> list[tuple[int, int, str]]:
    """Committed version folders as (version, rev, name), oldest first."""
    found = [(*p, n) for n in os.listdir(root)
             if (p := parse_folder(n)) and os.path.isdir(os.path.join(root, n))]
    return sorted(found)


def latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def read_manifest(dir: str | os.PathLike, version: int | None = None) -> dict[str, Any]:
    """The manifest of ``version`` (its newest revision), or of the newest version when None."""
    root = os.fspath(dir)
    if version is None:
        folder = latest(root)
        if folder is None:
            raise MilesError(f"no weights in {root}: there is no {LATEST} file")
    else:
        folders = [n for v, _, n in committed(root) if v == int(version)] if os.path.isdir(root) else []
        if not folders:
            raise MilesError(f"no weights of version {version} in {root}")
        folder = folders[-1]
    try:
        with open(os.path.join(root, folder, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise MilesError(f"cannot read the manifest of {os.path.join(root, folder)}: {e}") from e


def load_version(dir: str | os.PathLike, version: int | None = None, *,
                 verify: bool = False) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(HF name, tensor) of every tensor of a version, read shard by shard.

    The manifest is read now (so a missing version fails here), the tensors lazily.
    ``verify`` recomputes each tensor's checksum and raises ``MilesError`` naming it on a mismatch.
    """
    root = os.fspath(dir)
    manifest = read_manifest(root, version)
    by_file: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, entry in manifest["tensors"].items():
        by_file.setdefault(entry["file"], []).append((name, entry))
    return _stream(root, by_file, verify)


def _stream(root: str, by_file: dict, verify: bool) -> Iterator[tuple[str, "torch.Tensor"]]:
    from safetensors import SafetensorError, safe_open

    # one shard open at a time: delta manifests spread tensors over several version folders
    for file, items in by_file.items():
        path = os.path.join(root, file)
        try:
            handle = safe_open(path, framework="pt")
        except (OSError, SafetensorError) as e:
            raise MilesError(f"cannot open shard {path} (holds {items[0][0]}): {e}") from e
        with handle as f:
            for name, entry in items:
                try:
                    t = f.get_tensor(entry["key"])
                except (OSError, SafetensorError) as e:
                    raise MilesError(f"cannot read tensor {name} from {path}: {e}") from e
                _check(name, entry, t, verify)
                yield name, t


def _check(name: str, entry: dict[str, Any], t: "torch.Tensor", verify: bool) -> None:
    if dtype_name(t.dtype) != entry["dtype"] or list(t.shape) != entry["shape"]:
        raise MilesError(f"weight sync: tensor {name} on disk is {dtype_name(t.dtype)}{list(t.shape)}, "
                         f"the manifest says {entry['dtype']}{entry['shape']}")
    if verify and "blake2b" not in entry:
        raise MilesError(f"weight sync: tensor {name} was written without a checksum, so it cannot be "
                         "verified (the writer computes them when sync.verify or sync.delta is on)")
    if verify and checksum(t) != entry["blake2b"]:
        raise MilesError(f"weight sync verification failed: tensor {name} in {entry['file']} "
                         "does not match its manifest checksum (corrupted shard?)")
