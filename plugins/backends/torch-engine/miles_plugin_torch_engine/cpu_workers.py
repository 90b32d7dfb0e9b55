"""Threads of one intra-op thread each for the CPU fast path (``CpuFastGenerator``): a driver
that runs ``generate`` and the first row slice of every step, and ``k - 1`` workers for the others.

A decode step of a small model is a few dozen ops per layer; with two intra-op threads each one
is an OpenMP fork/join, and at these shapes the GEMMs gain only ~1.3-1.7x from the second thread.
Two threads that each run the whole step on half of the rows meet once per step. A 16 x 8 x
32-token Qwen2 generation (hidden 256, 6 layers) on 2 cores: about as fast as two intra-op
threads when the cores are free (median 0.62-0.73 s against 0.66-0.73 s), and when other
processes take them an OpenMP team stalls at every op (1.0-2.3 s against 1.1 s to 27 s, one
intra-op thread 1.0-1.3 s). The caller's own team is never woken: after each parallel op its
threads spin for milliseconds, on the cores the workers need (that alone cost 0.7 s here).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_lock = threading.Lock()
os.register_at_fork(after_in_child=_pools.clear)  # a forked child has none of the threads


def _one_thread() -> None:
    torch.set_num_threads(1)
    torch.get_num_threads()  # a thread takes the default count at its first parallel query: now


def pool(k: int, role: str = "workers") -> ThreadPoolExecutor:
    """``k`` threads of one intra-op thread each, one pool per ``role`` and size per process.
    ``torch.set_num_threads`` is per thread, but also sets the default that a thread takes at its
    first use of torch: all ``k`` start and take 1 here (a barrier holds each first task on its own
    thread), then the caller's count, and the default, are set back."""
    with _lock:
        if (role, k) not in _pools:
            prev = torch.get_num_threads()
            workers = ThreadPoolExecutor(k, thread_name_prefix=f"miles-engine-{role}", initializer=_one_thread)
            start = threading.Barrier(k)
            list(workers.map(lambda _: start.wait(), range(k)))
            torch.set_num_threads(prev)
            _pools[role, k] = workers
        return _pools[role, k]


def slices(rows: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ``(start, stop)`` ranges of ``rows`` of about equal size."""
    bounds = [round(i * rows / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
