"""Worker-thread pools for the CPU fast paths, one registry per process.

A small model's op is too short for an OpenMP team: each op forks and joins every intra-op
thread, and a team stalls whenever another process takes one of its cores. The fast paths instead
split a batch over worker threads that each run whole slices with their own (small, usually 1)
intra-op thread count. Pools are kept for the life of the process (creating threads per call
would cost more than the work) and are keyed by ``(role, k, threads)``: the engine's decode
workers and driver, and the trainer's data-parallel workers, never share a pool.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_pools: dict[tuple[str, int, int], ThreadPoolExecutor] = {}
_lock = threading.Lock()
os.register_at_fork(after_in_child=_pools.clear)  # a forked child has none of the threads


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)
    torch.get_num_threads()  # a thread takes the default count at its first parallel query: now


def pool(k: int, role: str = "workers", threads: int = 1) -> ThreadPoolExecutor:
    """``k`` threads of ``threads`` intra-op threads each, one pool per ``(role, k, threads)`` per
    process, all ``k`` started on return.

    ``torch.set_num_threads`` is per thread but also sets the default that a new thread takes at
    its first use of torch: each thread sets its own count as it starts (a barrier holds each
    first task on its own thread, so all ``k`` exist), then the caller's count, and with it the
    default, is set back.
    """
    if k < 1 or threads < 1:
        raise ValueError(f"a worker pool needs k >= 1 threads of >= 1 intra-op threads, got k={k}, "
                         f"threads={threads}")
    key = (role, k, threads)
    with _lock:
        if key not in _pools:
            prev = torch.get_num_threads()
            workers = ThreadPoolExecutor(k, thread_name_prefix=f"miles-{role}", initializer=_set_threads,
                                         initargs=(threads,))
            start = threading.Barrier(k)
            list(workers.map(lambda _: start.wait(), range(k)))
            torch.set_num_threads(prev)
            _pools[key] = workers
        return _pools[key]
