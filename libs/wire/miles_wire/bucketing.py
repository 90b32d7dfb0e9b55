"""Bucketing: a ``(name, tensor)`` stream cut into groups of at most N bytes, and the time spent
producing them (gathering shards, waiting for CUDA kernels)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .dtypes import nbytes

if TYPE_CHECKING:  # pragma: no cover
    import torch


def buckets(named: Iterable[tuple[str, torch.Tensor]], limit: int,
            first: int | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
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


def timed(named: Iterable[tuple[str, torch.Tensor]], spent: list[float]) -> Iterator[tuple[str, Any]]:
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


def ready(bucket: Sequence[tuple[str, torch.Tensor]], spent: list[float]) -> None:
    """Wait until the CUDA kernels producing ``bucket``'s tensors are done, adding the wait to
    ``spent[0]`` (with ``timed``: the full cost of producing the bucket)."""
    import time

    if bucket and bucket[0][1].is_cuda:
        import torch

        t0 = time.perf_counter()
        torch.cuda.current_stream(bucket[0][1].device).synchronize()
        spent[0] += time.perf_counter() - t0
