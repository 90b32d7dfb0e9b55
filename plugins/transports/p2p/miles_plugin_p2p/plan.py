"""Who writes what: buckets over the trainer's tensors, and the (bucket, engine rank) writes of
each trainer rank. Pure functions (no torch, no NIXL)."""
from __future__ import annotations

from collections.abc import Sequence


def cut(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` runs of tensor indices of at most ``limit`` bytes each (a
    larger tensor forms a run of its own)."""
    runs, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > limit:
            runs.append((start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


def plan(num_buckets: int, engine_ranks: int, trainer_ranks: int = 1) -> list[list[tuple[int, int]]]:
    """Per trainer rank, the ``(bucket, engine rank)`` writes it makes. Every engine rank gets
    every bucket; write ``k = bucket * engine_ranks + engine`` goes to trainer rank
    ``k % trainer_ranks`` (round-robin over engine ranks: with as many engine ranks as trainer
    ranks, each trainer rank feeds one engine rank; with fewer, the buckets are split)."""
    if engine_ranks < 0 or trainer_ranks < 1 or num_buckets < 0:
        raise ValueError(f"plan: {num_buckets} buckets, {engine_ranks} engine ranks, "
                         f"{trainer_ranks} trainer ranks")
    out: list[list[tuple[int, int]]] = [[] for _ in range(trainer_ranks)]
    for b in range(num_buckets):
        for e in range(engine_ranks):
            out[(b * engine_ranks + e) % trainer_ranks].append((b, e))
    return out
