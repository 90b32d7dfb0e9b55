"""The speculative step replayed from CUDA graphs, as ``cuda_graphs.DecodeRunner`` replays decode.

A speculative step is ``k`` draft steps, a verify block of ``k + 1`` positions per row over the
KV cache and the rejection-sampling verification: over a thousand small kernels for a 24-layer
model, which eager PyTorch launched one by one at ~10x the cost of a graphed plain decode step.
Here the whole step is one graph per (row bucket, length bucket, sampling parameters): it reads
and advances in place fixed buffers (the scheduler's ``tok`` / ``pos``, the rows' tokens, log-probs,
counts and flags, the draft's state, the KV caches, the acceptance counters), so the host launches
one graph a step and reads nothing back. Rows past the live batch are scratch (free cache rows at
position 0, flagged finished so that they emit nothing), as in decode.

Random numbers: the uniforms of the step's draws (``k`` drafts, ``k`` acceptance tests and the
residual's draw per row) are drawn eagerly from the request's generator into a fixed buffer before
each replay, so a graph holds no generator state and a seeded request stays seeded. Sampling
parameters (temperature, top-k, top-p) are captured as constants, hence part of the key.

Graphs are captured lazily, share one memory pool, and are dropped when the weights, the cache
or the state buffers they read are re-allocated. Without graphs (CPU, ``engine.cuda_graphs:
false``, or a capture that failed) the same step runs eagerly, drawing from the generator itself.
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable, Sequence

import torch

from .cuda_graphs import batch_buckets, capture_graph

log = logging.getLogger(__name__)

Step = Callable[[int, "int | None", "torch.Tensor | None"], None]


class SpecGraphs:
    """The speculative step ``step(size, length, u)`` over rows ``[0, size)``, which advances its
    state in place, replayed from CUDA graphs (one per row bucket, length key and sampling mode)."""

    def __init__(self, device: torch.device, use_graphs: bool, state: Callable[[], Sequence[torch.Tensor]] = tuple):
        """``state``: the tensors a step advances in place; a capture's warm-up run is undone on them."""
        self.device = device
        self.state = state
        self.use_graphs = use_graphs and device.type == "cuda"
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._key: tuple = ()
        self.u: torch.Tensor | None = None
        self._buckets: list[int] = []

    def prepare(self, key: tuple, slots: int, uniforms: int) -> None:
        """Forget graphs captured over other buffers (``key``: their addresses and sizes); the
        uniforms buffer ``[slots, uniforms]``."""
        if key == self._key:
            return
        self._graphs.clear()
        self._pool = None  # a pool whose graphs are gone takes no new captures
        self._key = key
        self._buckets = batch_buckets(slots)
        if self.use_graphs:
            self.u = torch.zeros((slots, uniforms), dtype=torch.float32, device=self.device)

    def step(self, body: Step, live: int, length_key: int, length: int, mode: tuple,
             gen: torch.Generator) -> None:
        """``body`` over rows ``[0, live)``, from the graph of ``live``'s bucket (captured the first
        time it is needed); ``mode`` keys the sampling parameters ``body`` reads."""
        size = self._buckets[bisect.bisect_left(self._buckets, live)]
        graph_key = (size, length_key, mode)
        graph = self._graphs.get(graph_key)
        if graph is None:
            try:
                graph = self._graphs[graph_key] = self._capture(body, size, length)
            except RuntimeError as e:  # e.g. an op that syncs with the host: the step stays eager
                log.warning("speculative step: CUDA graph capture failed (%s); running it eagerly", e)
                self.use_graphs = False
                self._graphs.clear()
                body(live, None, None)
                return
        if mode != ("greedy",):
            self.u[:size].uniform_(generator=gen)
        graph.replay()

    def _capture(self, body: Step, size: int, length: int) -> torch.cuda.CUDAGraph:
        def run() -> None:
            body(size, length, self.u[:size])

        saved = [t.clone() for t in self.state()]

        def undo() -> None:
            for t, v in zip(self.state(), saved):
                t.copy_(v)

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_graph(run, self.device, self._pool, after_warmup=undo)
