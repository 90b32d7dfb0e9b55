"""Process groups of their own: a TCP store plus a gloo or NCCL group object that never touches
the default group, so a multi-rank trainer and a one-process engine can join it alike; byte
broadcasts over it."""
from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from miles import MilesError

from .dtypes import _uint8

if TYPE_CHECKING:  # pragma: no cover
    import torch


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


def broadcast(group: Any, t: torch.Tensor, root: int = 0, check: Any = None) -> None:
    """Broadcast ``t``'s bytes from ``root`` (see ``broadcast_all``)."""
    broadcast_all(group, [t], root, check)


def broadcast_all(group: Any, tensors: Sequence[torch.Tensor], root: int = 0, check: Any = None) -> None:
    """Broadcast each tensor's bytes from ``root``, in order, and wait for them (see ``post``)."""
    wait_all(post(group, tensors, root), check)


def post(group: Any, tensors: Sequence[torch.Tensor], root: int = 0) -> list:
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


# one gloo group per default process group, for Python objects and barriers: a second trainer in
# the same process (warm start -> RL) reuses it instead of creating another
_OBJECT_GROUPS: dict[int, Any] = {}


def object_group() -> Any:
    """A gloo group over the whole default group (``None``, the default group itself, when that is
    already gloo), for ``broadcast_object_list`` and barriers next to an NCCL default group. The
    first call is a collective: every rank must make it in the same order as its other
    ``new_group`` calls."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _OBJECT_GROUPS:
        _OBJECT_GROUPS[key] = dist.new_group(backend="gloo")
    return _OBJECT_GROUPS[key]


def drop_object_groups() -> None:
    """Forget the cached object groups; call it when the default group is destroyed (a later
    default group may reuse the old one's ``id``)."""
    _OBJECT_GROUPS.clear()
