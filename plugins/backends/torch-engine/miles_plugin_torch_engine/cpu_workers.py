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

# the process-wide pool registry is shared with the fsdp2 trainer's workers (``pool(k, role)``)
from miles_fastpath.threads import pool  # noqa: F401


def slices(rows: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ``(start, stop)`` ranges of ``rows`` of about equal size."""
    bounds = [round(i * rows / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
