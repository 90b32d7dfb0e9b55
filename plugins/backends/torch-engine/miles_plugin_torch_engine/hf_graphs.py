"""The model's own forward (``impl: hf``) decoding over a transformers ``StaticCache``, the decode
step replayed from a CUDA graph.

Eager, a decode step of the model's own forward is hundreds of small kernels launched one by one
from Python, and the GPU waits on the launches. A graph launches the whole step at once, but it
replays fixed addresses and fixed control flow: the cache must be preallocated and updated in
place, and no step may read device data on the host. transformers' static cache layers are built
that way (their fill level is a device tensor, and the mask builders skip their host reads while a
stream is capturing) for full attention, DSA's indexer keys, and linear attention's convolution
and recurrent states. Sliding-window layers get full-length layers here, the window applied by the
mask: a rolling layer keeps its fill level on the host, which a replayed graph would not follow.

Each generate chunk captures its own graph, right after its first decode step, which runs eagerly
on a side stream and so warms kernels and workspaces outside the capture. The graph thus always
reads the weights and cache of its chunk: a weight sync between calls needs no bookkeeping.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

_log = logging.getLogger(__name__)

MIN_STEPS = 4  # shorter decodes stay eager: the capture costs about one step of launches


def static_layers(model: torch.nn.Module) -> bool:
    """Whether transformers has a static cache layer for each of the model's layer types (not for
    DeepSeek-V4's compressed attention, whose cache grows by compressed blocks)."""
    try:
        from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs
    except ImportError:  # a transformers release without per-layer static caches
        return False
    try:
        kinds, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    except (AttributeError, KeyError, ValueError):
        return False
    return all(kind in STATIC_LAYER_TYPE_MAPPING for kind in kinds)


def static_cache(model: torch.nn.Module, length: int) -> Any:
    """A ``StaticCache`` of ``length`` positions for ``model``, sliding layers at full length."""
    from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer

    cache = StaticCache(config=model.config, max_cache_len=length)
    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer:  # hybrids with linear attention keep their class
            cache.layers[i] = StaticLayer(max_cache_len=length)
    return cache


class GraphStep:
    """``forward(tok, pos)``, a decode step over a static cache that returns ``[rows, V]`` logits:
    run eagerly on the first call (on a side stream, the warm-up), captured as a CUDA graph right
    after it, and replayed from then on. The inputs are copied into fixed buffers at each call; the
    logits returned are the graph's own buffer, valid until the next call."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], recorder: Any = None):
        self.forward = forward
        # a miles.protocols.RecordsGraphReplays recorder: the captured routers' outputs, logged per replay
        self.recorder, self.routed = recorder, []
        self.tok = self.pos = self.logits = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.forward_eager = False

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if tok.device.type != "cuda" or self.forward_eager:  # CPU: the same static-cache step, eager
            return self.forward(tok, pos)
        if self.graph is not None:
            self.tok.copy_(tok)
            self.pos.copy_(pos)
            self.graph.replay()
            if self.recorder is not None:
                self.recorder.log_copies(self.routed)
            return self.logits
        self.tok, self.pos = tok.clone(), pos.clone()
        device = tok.device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            first = self.forward(self.tok, self.pos)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        mark = self.recorder.mark() if self.recorder is not None else 0
        try:
            # records the next step, nothing runs until replay; thread_local: CUDA calls of other
            # threads meanwhile (a server's, a device-telemetry sampler's) do not void the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.logits = self.forward(self.tok, self.pos)
        except RuntimeError as e:  # a layer that reads device data on the host cannot be captured
            if self.recorder is not None:
                self.recorder.split_off(mark)  # the failed capture's routers computed nothing
            _log.warning("torch engine: the decode step could not be captured as a CUDA graph (%s); "
                         "this chunk decodes eagerly (engine.cuda_graphs: false skips the capture)", e)
            self.forward_eager = True
            return first
        if self.recorder is not None:  # the capture's routing entries are the graph's buffers, not a step
            self.routed = self.recorder.split_off(mark)
        self.graph = graph
        return first
