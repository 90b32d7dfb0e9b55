"""Data parallelism over the CPU cores of one process (world size 1 on CPU).

Each of ``k`` worker threads runs its slice of the batch (whole runs of rows sharing a prompt)
with one intra-op thread (or a few, on many cores), instead of every op being split over all
OpenMP threads: the matmuls of a small model scale poorly over threads (on a 2-core machine MKL
gets 1.2-1.3x from 2 threads for these shapes, two independent slices nearly 2x), and an OpenMP
team stalls badly whenever another process takes one of its cores, where a single-threaded worker
just slows down.

The loss is computed once, on the whole batch, on the calling thread (so its metrics and value are
exactly the single-pass ones); only its gradient with respect to the log-probs goes back to the
workers, which backpropagate their slices concurrently. Their parameter gradients are summed in a
fixed order, so a step is deterministic.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from miles import Batch
from miles_fastpath.threads import pool


class Workers:
    """``k`` worker threads of ``threads`` intra-op threads each."""

    def __init__(self, k: int, threads: int = 1):
        self.k, self.threads = k, threads
        self.pool = pool(k, "trainer", threads)  # shared by every trainer of the process

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on one worker."""
        return self.pool.submit(fn, *args).result()

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return list(self.pool.map(fn, items))


def chunks(runs: list[int], k: int) -> list[tuple[int, int]]:
    """At most ``k`` contiguous ``(start, stop)`` row ranges of about equal size, cut between runs
    of rows sharing a prompt where there are at least ``k`` runs (a run cut in two runs its
    prompt twice)."""
    B = sum(runs)
    k = min(k, B)
    if k <= 1:
        return [(0, B)]
    ends = list(itertools.accumulate(runs))
    cuts = []
    for i in range(1, k):
        target = round(i * B / k)
        cut = min(ends, key=lambda e: abs(e - target)) if len(runs) >= k else target
        if 0 < cut < B and (not cuts or cut > cuts[-1]):
            cuts.append(cut)
    bounds = [0, *cuts, B]
    return list(itertools.pairwise(bounds))


def _rows(batch: Batch, a: int, b: int) -> Batch:
    return batch if (a, b) == (0, len(batch)) else batch.select(list(range(a, b)))


def logprobs(fn: Callable[[Batch], torch.Tensor], batch: Batch, runs: list[int], w: Workers) -> torch.Tensor:
    """``fn(batch)`` computed slice by slice on the workers, rows in order, in the caller's grad and
    inference modes (both thread-local)."""
    parts = [_rows(batch, a, b) for a, b in chunks(runs, w.k)]
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(part: Batch) -> torch.Tensor:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn(part)

    return torch.cat(w.map(run, parts))


def train(fn: Callable[[Batch], torch.Tensor], model: torch.nn.Module, batch: Batch, runs: list[int],
          w: Workers, loss_fn: Callable[[Batch, torch.Tensor], Any]) -> Any:
    """Forward on the workers, ``loss_fn(batch, logprobs)`` here, backward on the workers; the
    parameters' ``.grad`` accumulate the gradient as ``loss.backward()`` would. Returns what
    ``loss_fn`` returned."""
    bounds = chunks(runs, w.k)
    lps = w.map(lambda ab: fn(_rows(batch, *ab)), bounds)
    lp = torch.cat([x.detach() for x in lps]).requires_grad_()
    out = loss_fn(batch, lp)
    (g,) = torch.autograd.grad(out[0], lp, allow_unused=True)
    if g is None:  # the loss does not depend on the log-probs: no gradient
        return out
    params = [p for p in model.parameters() if p.requires_grad]

    def backward(i: int) -> tuple[torch.Tensor | None, ...]:
        a, b = bounds[i]
        return torch.autograd.grad(lps[i], params, g[a:b], allow_unused=True)

    grads = w.map(backward, list(range(len(bounds))))

    def accumulate(share: list[int]) -> None:  # the workers sum the slices' gradients too
        with torch.no_grad():
            for i in share:
                gs = [x[i] for x in grads if x[i] is not None]
                if not gs:
                    continue
                total = gs[0]
                for x in gs[1:]:
                    total = total + x
                p = params[i]
                if p.grad is None:
                    p.grad = total
                else:
                    p.grad += total

    w.map(accumulate, _shares([p.numel() for p in params], w.k))
    return out


def _shares(sizes: list[int], k: int) -> list[list[int]]:
    """Indices of ``sizes`` in ``k`` lists of about equal total size (largest first, to the lightest)."""
    shares: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = load.index(min(load))
        shares[j].append(i)
        load[j] += sizes[i]
    return shares
