"""Which library multiplies by the weights in the CPU fast paths (the torch engine's decode steps,
the fsdp2 trainer's log-prob forward and backward): torch's default BLAS (MKL in the PyPI builds)
or oneDNN, through the linear op torch ships for its Inductor CPU backend
(``torch.ops.mkldnn._linear_pointwise``; weights packed once by ``_reorder_linear_weight`` for
repeated calls). Both are float32 GEMMs; they round differently (each ~1e-7 relative per product
sum, neither closer to a float64 reference).

Measured on an AMD EPYC host (Zen 4, AVX-512), one thread, the layers of a 6-layer hidden-256
Qwen2 model (``benchmarks/cpu_gemm.py``): a decode step's GEMMs at 64 rows 8.6 ms on packed
oneDNN weights against 11-13 ms in MKL, a training forward's over 2,032 tokens 41-44 ms a layer
against 54-60 ms, its input gradients likewise; the weight gradients (both operands activations)
are no faster in oneDNN and stay in MKL. MKL is known to take generic code paths on CPUs that are
not Intel's. On an Intel Xeon (AVX-512) MKL was 1.25x faster at decode and on par in
training. Small layers lose in oneDNN (its per-call cost): the quickstart model's (hidden 128,
246k weights a layer) GRPO step was 6% slower. So ``auto`` picks oneDNN on AMD CPUs, where torch
has it, for models whose decoder layers hold at least ``ONEDNN_MIN_LAYER`` weights, and MKL
otherwise: by vendor and size, not by timing, so a run's numbers are the same every time on one
machine.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

CHOICES = ("auto", "mkl", "onednn")
ONEDNN_MIN_LAYER = 1 << 19  # weights of a decoder layer's linears (a 6-layer hidden-256 model: 983k)


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...; "" where /proc/cpuinfo is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def onednn_available() -> bool:
    import torch

    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def layer_weights(model: torch.nn.Module) -> int:
    """Weights of the linears of a Hugging Face decoder's first layer (``model.model.layers[0]``;
    0 for other layouts)."""
    import torch

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return 0
    return sum(m.weight.numel() for m in layers[0].modules() if isinstance(m, torch.nn.Linear))


def resolve(choice: str, layer_size: int = ONEDNN_MIN_LAYER) -> str:
    """``"mkl"`` or ``"onednn"`` for a config value of :data:`CHOICES` and a model whose decoder
    layers hold ``layer_size`` weights (:func:`layer_weights`); ValueError when oneDNN is asked
    for and this torch build has none (the caller names its config key)."""
    if choice not in CHOICES:
        raise ValueError(f"{choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "auto":
        big = layer_size >= ONEDNN_MIN_LAYER
        return "onednn" if big and cpu_vendor() == "AuthenticAMD" and onednn_available() else "mkl"
    if choice == "onednn" and not onednn_available():
        raise ValueError("this torch build has no oneDNN (torch.backends.mkldnn) linear op; use mkl or auto")
    return choice


def for_model(key: str, choice: str, model: torch.nn.Module) -> str:
    """:func:`resolve` for ``model`` (its :func:`layer_weights`) and the config value ``choice`` of
    ``key`` (``engine.cpu_gemm``, ``trainer.cpu_gemm``): a bad choice is a ``ConfigError`` naming it."""
    from miles import ConfigError

    try:
        return resolve(choice, layer_weights(model))
    except ValueError as e:
        raise ConfigError([f"{key}={choice}: {e}"]) from None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` in oneDNN's blocked layout, for :func:`linear` calls at any row count
    (the row count given here only sizes the blocking)."""
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in oneDNN, ``x [rows, in]``, ``weight [out, in]`` (plain or
    :func:`pack` ed); not differentiable (see :func:`trainable_linear`)."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               other: torch.Tensor) -> torch.Tensor:
    """``other + x @ weight.T + bias``, the add inside oneDNN's GEMM."""
    import torch

    return torch.ops.mkldnn._linear_pointwise.binary(x, other, weight, bias, "add")


def trainable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the forward and the input gradient in oneDNN (on the
    plain weight: no packing, so nothing goes stale when an optimizer updates it in place) and
    the weight and bias gradients as torch computes them (``dy.T @ x``, ``dy.sum(0)``)."""
    return _function().apply(x, weight, bias)


@functools.cache
def _function() -> type:  # torch is imported at first use, not with this module
    import torch

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            ctx.save_for_backward(x, weight)
            ctx.has_bias = bias is not None
            rows = x.reshape(-1, x.shape[-1])
            return linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

        @staticmethod
        def backward(ctx, dy):
            x, weight = ctx.saved_tensors
            dy2 = dy.reshape(-1, dy.shape[-1])
            need_x, need_w, need_b = ctx.needs_input_grad
            dx = linear(dy2, weight.t()).view(x.shape) if need_x else None
            dw = dy2.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None
            db = dy2.sum(0) if ctx.has_bias and need_b else None
            return dx, dw, db

    return Linear
