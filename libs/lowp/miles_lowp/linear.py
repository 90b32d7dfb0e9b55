"""The trainer's side of low precision: linear layers whose GEMMs run in a format, and the weights
the engines receive in that format.

* ``fp8``: forward ``y = Q(x, 1x128) @ Q(W, 128x128).T``; input gradient ``dy`` in 1x128 groups by
  the same weight blocks; weight gradient ``Q(dy.T, 1x128) @ Q(x.T, 1x128)`` (groups along the
  tokens), as DeepSeek-V3 trains. FP32 master weights and optimizer state stay as they are: only
  the GEMM operands are rounded. ``torch._scaled_mm`` on CUDA, emulated on CPU (same rounding).
* ``mxfp8``: the same three GEMMs with both operands in 32-element MX blocks along the reduction
  dimension (the weight re-quantized along its other dimension for the input gradient), emulated.
* ``qat: int4``: the forward's weight is fake-quantized to INT4 (straight-through estimator); the
  GEMM itself stays in the activations' dtype (W4A16).

3-D mixture-of-experts weights (``experts.gate_up_proj`` / ``down_proj``) are rounded weight-only
(the rounded weight forward, the identity backward): their GEMMs are the model's own.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from . import fp8 as f8
from . import int4 as i4
from . import mx

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _act(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, int, None]:
    """An operand quantized in groups along its last (reduction) dimension: ``(q, scale, block,
    None)`` (no 128x128 block scales)."""
    if fmt == "fp8":
        return (*f8.quantize_groups(x, f8.BLOCK), f8.BLOCK, None)
    q, biased = mx.quantize_mx(x)
    return q, mx.scales(biased), mx.MX_BLOCK, None


def _weight(w: torch.Tensor, fmt: str, transposed: bool = False) -> tuple:
    """The weight (or its transpose) as a grouped operand: fp8 keeps its 128x128 blocks either way
    (and passes their scales on, for cuBLAS' blockwise GEMM)."""
    if fmt == "fp8":
        q, s = f8.quantize_blockwise(w)
        operand = (q, f8.block_row_scales(s, q.shape[0]), f8.BLOCK, s)
        return _transposed(operand) if transposed else operand
    return _act(w.t() if transposed else w, fmt)


def _gemm(a: tuple, b: tuple, emulate: bool, out_dtype: torch.dtype) -> torch.Tensor:
    (aq, sa, block, _), (bq, sb, _, blocks) = a, b
    return f8.grouped_mm(aq, sa, bq, sb, block, emulate=emulate, sb_blocks=blocks, out_dtype=out_dtype)


def _transposed(w: tuple) -> tuple:
    """A 128x128-blocked fp8 weight operand as the operand of its transpose: the same blocks and
    scales, transposed (quantizing ``w.T`` again would give these very values)."""
    q, _, block, s = w
    q, s = q.t().contiguous(), s.t()
    return q, f8.block_row_scales(s, q.shape[0]), block, s


class _LowpMatmul(torch.autograd.Function):
    """``x [T, K] @ w [N, K].T`` with every GEMM of forward and backward in ``fmt``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fmt: str, emulate: bool) -> torch.Tensor:
        wq = _weight(w, fmt)
        # fp8: the input gradient reuses the forward's weight blocks (saved in fp8, a quarter of
        # the float32 weight) instead of quantizing the weight a second time
        ctx.save_for_backward(x, w, *((wq[0], wq[3]) if fmt == "fp8" else ()))
        ctx.fmt, ctx.emulate = fmt, emulate
        return _gemm(_act(x, fmt), wq, emulate, x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, w, *blocks = ctx.saved_tensors
        fmt, emulate = ctx.fmt, ctx.emulate
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt = _transposed((blocks[0], None, f8.BLOCK, blocks[1])) if blocks else _weight(w, fmt, transposed=True)
            dx = _gemm(_act(dy, fmt), wt, emulate, x.dtype)
        if ctx.needs_input_grad[1]:
            dw = _gemm(_act(dy.t(), fmt), _act(x.t(), fmt), emulate, w.dtype)
        return dx, dw, None, None


def lowp_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, fmt: str,
                emulate: bool | None = None) -> torch.Tensor:
    """``F.linear`` whose three GEMMs run in ``fmt`` (``fp8`` or ``mxfp8``); ``emulate`` defaults
    to CPUs for fp8 and everywhere for mxfp8 (no MX tensor cores on Hopper)."""
    if emulate is None:
        emulate = fmt == "mxfp8" or not x.is_cuda
    y = _LowpMatmul.apply(x.reshape(-1, x.shape[-1]), w, fmt, emulate).reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b.to(y.dtype)


def qdq(w: torch.Tensor, fmt: str, name: str = "") -> torch.Tensor:
    """``w`` rounded to ``fmt`` as the engines serve it, in ``w``'s dtype (no gradient)."""
    w = w.detach()
    if fmt == "int4":
        return i4.qdq_int4(w)
    if fmt == "fp8":
        halves = 2 if name.endswith("gate_up_proj") else 1
        return f8.dequantize_blockwise(*f8.quantize_blockwise(w, halves=halves), w.dtype, halves=halves)
    return mx.qdq_mx(w)


def rounded(w: torch.Tensor, fmt: str, name: str = "") -> torch.Tensor:
    """``w`` as a format serves it, with the straight-through gradient (the weight-only path)."""
    return w + (qdq(w, fmt, name) - w).detach()


class LowpLinear(torch.nn.Linear):
    """An ``nn.Linear`` computing in ``fmt`` over the same parameters (names unchanged, so the
    optimizer, checkpoints and weight names are the plain model's)."""

    def __init__(self, linear: torch.nn.Linear, fmt: str):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "int4":
            return F.linear(x, i4.fake_int4(self.weight), self.bias)
        return lowp_linear(x, self.weight, self.bias, self.fmt)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fmt={self.fmt}"


class RoundedExperts(torch.nn.Module):
    """A mixture-of-experts block's experts with their 3-D weights rounded to ``fmt`` in the forward.

    It holds the experts module's own parameter, buffer and child dicts (the same objects, so the
    names and the optimizer's parameters stay the plain model's) and runs that module's forward with
    the rounded weights through ``torch.func.functional_call``."""

    def __init__(self, experts: torch.nn.Module, fmt: str):
        super().__init__()
        self._parameters, self._buffers, self._modules = experts._parameters, experts._buffers, experts._modules
        object.__setattr__(self, "inner", experts)  # not a child: its names are already ours
        self.fmt = fmt

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        weights = {a: rounded(self._parameters[a], self.fmt, a) for a in EXPERT_WEIGHTS}
        return torch.func.functional_call(self.inner, weights, args, kwargs, strict=False)


def _is_experts(m: torch.nn.Module) -> bool:
    return all(isinstance(getattr(m, a, None), torch.nn.Parameter) and getattr(m, a).dim() == 3
               for a in EXPERT_WEIGHTS)


def convert(model: torch.nn.Module, precision: str = "bf16", qat: str | None = None,
            scope: str = "all") -> dict[str, str]:
    """Make ``model`` compute in ``precision`` (``fp8``, ``mxfp8``) or with ``qat`` (``int4``) in
    place; returns ``{weight name: format}`` of the weights converted (empty for bf16 without QAT).

    Converted: every ``nn.Linear`` but the output head, and 3-D expert weights; ``scope="experts"``
    (QAT only) keeps to expert weights: 3-D ones and linears inside a module named ``experts``."""
    fmt = qat or (precision if precision in ("fp8", "mxfp8") else None)
    if fmt is None:
        return {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    done: dict[str, str] = {}
    for name, mod in list(model.named_modules()):
        expert_linear = ".experts." in f".{name}."
        if type(mod) is torch.nn.Linear and mod is not head and (scope == "all" or expert_linear):
            new: torch.nn.Module = LowpLinear(mod, fmt)
            done[f"{name}.weight"] = fmt
        elif _is_experts(mod):
            new = RoundedExperts(mod, fmt)
            done.update({f"{name}.{a}": fmt for a in EXPERT_WEIGHTS})
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return done


def packed(name: str, w: torch.Tensor, fmt: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors that carry weight ``name`` to an engine serving ``fmt``: fp8 ``name`` (e4m3) and
    ``name_scale_inv`` (128x128 blocks; a fused gate/up expert weight per half); mxfp8 ``name``
    (e4m3) and ``name_scale`` (E8M0 bytes); int4 ``name_packed`` (two values a byte) and
    ``name_scale`` (float32 per 128)."""
    if fmt == "int4":
        q, s = i4.quantize_packed(w.detach())
        return [(f"{name}_packed", q), (f"{name}_scale", s)]
    if fmt == "fp8":
        q, s = f8.quantize_blockwise(w.detach(), halves=2 if name.endswith("gate_up_proj") else 1)
        return [(name, q), (f"{name}_scale_inv", s)]
    q, s = mx.quantize_mx(w.detach())
    return [(name, q), (f"{name}_scale", s)]


def served_weights(named: Iterable[tuple[str, torch.Tensor]], formats: dict[str, str]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with each weight listed in ``formats`` rounded as the engines serve it, in its own
    dtype: a checkpoint any loader reads, holding the very values rollout computed with."""
    for name, t in named:
        fmt = formats.get(name)
        yield name, (qdq(t, fmt, name) if fmt is not None else t)


def packed_weights(named: Iterable[tuple[str, torch.Tensor]], formats: dict[str, str]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with each weight listed in ``formats`` replaced by its :func:`packed` tensors."""
    for name, t in named:
        fmt = formats.get(name)
        yield from (packed(name, t, fmt) if fmt is not None else [(name, t)])


class SendsPackedWeights:
    """``miles.protocols.SendsPacked`` for a trainer with ``named_weights()`` and ``packed_formats``
    (HF name -> format of each weight its forward rounds): what the engines receive and what
    ``miles export`` writes, the same rounding as the forward's."""

    packed_formats: dict[str, str]

    def packed_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``named_weights()`` with each rounded weight replaced by its packed tensors and scales."""
        return packed_weights(self.named_weights(), self.packed_formats)

    def served_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``named`` with the weights the forward rounds rounded the same way (``miles export``)."""
        return served_weights(named, self.packed_formats)
