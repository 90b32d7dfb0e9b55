"""Decode steps replayed from CUDA graphs, one graph per (batch-size bucket, cache-length bucket).

A decode step of a small model is hundreds of tiny kernels; launching them one by one from Python
costs more than running them. A graph launches the whole step at once. Graphs need static shapes
and addresses, so the step reads its inputs from fixed buffers (``tok``, ``pos``), writes logits
into a fixed buffer, and runs at the next bucket size up: rows past the live batch are scratch
(free cache rows at position 0) whose outputs are ignored.

Graphs are captured lazily, the first time a bucket is needed, and share one memory pool (they
replay one at a time). They are dropped when a weight tensor is re-allocated (a graph replays
fixed addresses) or the KV cache grows.
"""
from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from .fast import RowsForward

_log = logging.getLogger(__name__)


def batch_buckets(slots: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 32 to 256, of 64 beyond: few graphs, little padding."""
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 256, 32)) + list(range(256, slots, 64))
    return sorted({s for s in sizes if s < slots} | {slots})



def capture_graph(run: Callable[[], None], device: torch.device, pool: Any,
                  after_warmup: Callable[[], None] | None = None) -> torch.cuda.CUDAGraph:
    """``run`` captured as a CUDA graph in ``pool``, after one warm-up on a side stream (kernel
    selection and workspaces happen outside capture); ``after_warmup`` undoes what the warm-up
    changed, for a ``run`` that advances state in place."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    if after_warmup is not None:
        after_warmup()
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA calls of other threads meanwhile (a server's, a telemetry sampler's) do not
    # void the capture
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        run()
    return graph

class DecodeRunner:
    """Runs ``forward.decode`` on rows ``[0, B)`` eagerly (CPU, or graphs off) or through graphs."""

    LENGTH_STEP = 128  # cache-length bucket granularity: attention reads only this much past the need

    def __init__(self, forward: RowsForward, use_graphs: bool):
        self.fwd = forward
        self.use_graphs = use_graphs and forward.device.type == "cuda"
        self.tok = self.pos = self.logits = None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._key: tuple = ()

    def prepare(self) -> None:
        """Static buffers sized to the cache; forget graphs made for other weights or cache."""
        f = self.fwd
        key = (f.weights_signature(), f.slots, f.max_len, f.k_cache.data_ptr())
        if key == self._key:
            return
        # a graph's pool cannot take new captures once its graphs are gone: new pool, new graphs
        self._graphs.clear()
        self._pool = None
        self._key = key
        vocab = f.model.lm_head.weight.shape[0]
        self.tok = torch.zeros(f.slots, dtype=torch.long, device=f.device)
        self.pos = torch.zeros(f.slots, dtype=torch.long, device=f.device)
        self.logits = torch.empty((f.slots, vocab), dtype=f.dtype, device=f.device)
        self._buckets = batch_buckets(f.slots)

    def step(self, batch: int, need: int) -> torch.Tensor:
        """Logits ``[batch, V]`` for the tokens in ``tok[:batch]`` at ``pos[:batch]``; ``need`` is
        one more than the largest live position."""
        if not self.use_graphs:
            return self.fwd.decode(self.tok[:batch], self.pos[:batch], need, out=self.logits[:batch])
        size = self._buckets[bisect.bisect_left(self._buckets, batch)]
        length = min(self.fwd.max_len, -(-need // self.LENGTH_STEP) * self.LENGTH_STEP)
        graph = self._graphs.get((size, length))
        if graph is None:
            try:
                graph = self._graphs[(size, length)] = self._capture(size, length)
            except RuntimeError as e:  # a layer of the model's own forward that reads device data on the host
                _log.warning("torch engine: the decode step could not be captured as a CUDA graph (%s); "
                             "decoding eagerly (engine.cuda_graphs: false skips the capture)", e)
                self.use_graphs = False
                return self.step(batch, need)
        graph.replay()
        return self.logits[:batch]

    def scrub(self, start: int) -> None:
        """Rows from ``start`` on are scratch: position 0 keeps their cache writes in bounds."""
        self.pos[start:] = 0
        self.tok[start:] = 0

    def _capture(self, size: int, length: int) -> torch.cuda.CUDAGraph:
        def run():
            self.fwd.decode(self.tok[:size], self.pos[:size], length, out=self.logits[:size])

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_graph(run, self.fwd.device, self._pool, self.fwd.saved_state())
