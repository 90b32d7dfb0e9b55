"""CUDA graphs of the sampler's per-step velocity (``engine.cuda_graphs``).

At small shapes a denoising step costs more CPU time launching the transformer's few hundred
kernels than GPU time running them. Each input signature (batch size, latent and conditioning
shapes, dtypes, guidance) gets one ``torch.cuda.CUDAGraph`` of ``sde.velocity``, captured once
and replayed at every step: a step is then two copies into static buffers and one graph launch.

Only the velocity is captured. The ODE update is two kernels and its result must outlive the
next replay (it is the trajectory), so capturing it would trade them for a copy; the SDE update
draws its noise from the caller's seeded generator, which stays eager so the noise, and hence
the samples and log-probs, are exactly those of the eager sampler.

The graphs read the transformer's parameters at the addresses they had at capture. That is safe
because ``DiffusersEngine.load_weights`` copies new weights in place (``Tensor.copy_``) into the
same parameter tensors: a replay after a weight sync computes with the new weights. Code that
replaced a parameter tensor (``module.to(...)``, assigning ``.data``) would have to clear the graphs.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from . import sde

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class VelocityGraphs:
    """``sde.velocity`` of one model, captured per input signature; the ``keep`` most recently
    used graphs are kept (each holds a private memory pool of the step's activations)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, keep: int = 4, warmup: int = 2):
        self.model, self.device, self.keep, self.warmup = model, device, keep, warmup
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()

    def __len__(self) -> int:
        return len(self._graphs)

    def bind(self, x: torch.Tensor, cond: dict[str, torch.Tensor], guidance: float,
             timestep: torch.Tensor) -> Velocity:
        """The per-step function ``(x, timestep) -> velocity`` of one sampling call, whose
        conditioning (constant over the steps) is copied into the graph's buffers here. The
        velocity it returns is the graph's static output, overwritten by the next step: use it
        before the next call. ``x`` and ``timestep`` are the first step's (captured from if new)."""
        key = (tuple(x.shape), x.dtype, tuple(timestep.shape), timestep.dtype, float(guidance),
               tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in cond.items())))
        graph = self._graphs.get(key)
        if graph is None:
            graph = _Graph(self.model, self.device, x, timestep, cond, guidance, self.warmup)
            self._graphs[key] = graph
            while len(self._graphs) > self.keep:  # the least recently used goes first
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
            for k, v in cond.items():
                graph.cond[k].copy_(v)
        return graph.run


class _Graph:
    """One captured velocity call and its static inputs (``x``, ``timestep``, ``cond``) and output."""

    def __init__(self, model: torch.nn.Module, device: torch.device, x: torch.Tensor, timestep: torch.Tensor,
                 cond: dict[str, torch.Tensor], guidance: float, warmup: int):
        fmt = torch.contiguous_format  # a step's timestep is a broadcast view: its buffer is dense
        self.x, self.timestep = x.clone(memory_format=fmt), timestep.clone(memory_format=fmt)
        self.cond = {k: v.clone(memory_format=fmt) for k, v in cond.items()}
        self.device = device

        def call() -> torch.Tensor:
            return sde.velocity(model, self.x, None, self.cond, guidance, timestep=self.timestep)

        with torch.cuda.device(device):
            # eager calls on a side stream first (lazy initialisation, cuBLAS/attention workspaces,
            # the caching allocator's blocks), so that the capture records only the steady state
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    call()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: another thread of the process (e.g. a trainer on the same GPU) may
            # keep using CUDA while this one captures
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.out = call()

    def run(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.timestep.copy_(timestep)
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.out
