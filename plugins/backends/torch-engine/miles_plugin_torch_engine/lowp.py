"""INT4 and MXFP8 rollout weights (``engine.weights_dtype: int4 | mxfp8``), beside ``fp8.py``.

* ``int4`` (W4A16): each converted weight is held packed, two INT4 values a byte
  (``<weight>_packed`` uint8 ``[..., K/2]``) with one float32 scale per 128 weights of a row
  (``<weight>_scale``), symmetric, as ``trainer.qat: int4`` rounds them in its forward; on CUDA
  a Triton W4A16 GEMM reads them packed (``w4a16.py``), elsewhere they are dequantized to the
  activations' dtype first.
* ``mxfp8``: ``<weight>`` in e4m3 with ``<weight>_scale`` E8M0 bytes per 32 weights of a row; a
  linear layer's activations are rounded to MXFP8 too and the product taken in float32, exactly as
  ``trainer.precision: mxfp8`` computes (emulated: Hopper and CPUs have no MX tensor cores).

3-D expert weights are weight-only in both formats, as the trainer rounds them
(``miles_lowp.linear.RoundedExperts``): :class:`FP8Experts`' forward, with this format's
dequantization.

Weights arrive from the trainer either packed (its names above, as a QAT or MXFP8 trainer sends
them) or in full precision (quantized on arrival). The numerics are ``miles_lowp``'s.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from miles_lowp import int4 as i4
from miles_lowp import mx

from .fp8 import FP8Experts, FP8Linear

DATA_SUFFIX = {"int4": "_packed", "mxfp8": ""}
SCALE_SUFFIX = "_scale"


class _Format:
    """The storage and GEMM of one format for :class:`FP8Linear` / :class:`FP8Experts`' layout
    (mixed in before them, so their constructors and forwards use these)."""

    fmt = "int4"

    def _names(self, attr: str) -> tuple[str, str]:
        return attr + DATA_SUFFIX[self.fmt], attr + SCALE_SUFFIX

    def _store(self, attr: str, w: torch.Tensor) -> None:
        data, scale = self._names(attr)
        q, s = i4.quantize_packed(w.detach()) if self.fmt == "int4" else mx.quantize_mx(w.detach())
        if isinstance(getattr(self, data, None), torch.Tensor):
            getattr(self, data).copy_(q)
            getattr(self, scale).copy_(s)
        else:
            self.register_buffer(data, q)
            self.register_buffer(scale, s)

    @torch.no_grad()
    def quantize_into(self, attr: str, w: torch.Tensor) -> None:
        self._store(attr, w.to(getattr(self, self._names(attr)[0]).device))

    def _parts(self, attr: str) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = (getattr(self, n) for n in self._names(attr))
        return q, s

    def dequantized(self, attr: str, dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor:
        q, s = self._parts(attr)
        if index is not None:
            q, s = q[index], s[index]
        return i4.dequantize_packed(q, s, dtype=dtype) if self.fmt == "int4" else mx.dequantize_mx(q, s, dtype=dtype)

    def matmul(self, x: torch.Tensor, attr: str) -> torch.Tensor:
        if self.fmt == "mxfp8":  # the activations in MX blocks too, as the trainer's GEMM takes them
            return (mx.qdq_mx(x).float() @ self.dequantized(attr, torch.float32).t()).to(x.dtype)
        if x.is_cuda:  # the fused Triton W4A16 GEMM reads the packed weights (w4a16.py)
            from .w4a16 import supports, w4a16_linear

            q, s = self._parts(attr)
            if supports(x, q):
                return w4a16_linear(x, q, s)
        return F.linear(x, self.dequantized(attr, x.dtype))


class LowpLinear(_Format, FP8Linear):
    def __init__(self, linear: torch.nn.Linear, fmt: str):
        self.fmt = fmt
        super().__init__(linear)


class LowpExperts(_Format, FP8Experts):
    def __init__(self, experts: torch.nn.Module, fmt: str):
        self.fmt = fmt
        super().__init__(experts)


def convert(model: torch.nn.Module, fmt: str, scope: str = "all") -> "LowpWeights":
    """Replace the model's linear layers (not the output head) and 3-D expert weights by ``fmt``
    ones in place (``scope="experts"``: only expert weights, 3-D or linears under ``experts``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = [(n, m) for n, m in model.named_modules()
             if (type(m) is torch.nn.Linear and m is not head and (scope == "all" or ".experts." in f".{n}."))
             or FP8Experts.fits(m)]
    layers: dict[str, tuple[_Format, str]] = {}
    for name, mod in found:
        parent, _, attr = name.rpartition(".")
        new = LowpLinear(mod, fmt) if isinstance(mod, torch.nn.Linear) else LowpExperts(mod, fmt)
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        layers.update({f"{name}.{a}": (new, a) for a in new.HALVES})
    return LowpWeights(layers, fmt)


class LowpWeights:
    """Incoming weights of the converted layers: packed ones copied, full-precision ones quantized
    (the same ``divert`` as ``fp8.FP8Weights``)."""

    def __init__(self, layers: dict[str, tuple[_Format, str]], fmt: str):
        self.layers, self.fmt = layers, fmt
        self.parts: dict[str, tuple[_Format, str]] = {}  # packed tensor name -> (layer, buffer)
        for name, (mod, attr) in layers.items():
            data, scale = mod._names(attr)
            self.parts[name[:-len(attr)] + scale] = (mod, scale)
            if data != attr:
                self.parts[name[:-len(attr)] + data] = (mod, data)

    @torch.no_grad()
    def divert(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Loads the pairs that name converted weights; returns the others, for the usual copy."""
        rest = []
        for name, t in pairs:
            entry, part = self.layers.get(name), self.parts.get(name)
            if entry is not None and t.dtype == torch.float8_e4m3fn:  # MXFP8 data as the trainer sent it
                part = (entry[0], entry[0]._names(entry[1])[0])
            if part is not None:
                dst = getattr(*part)
                if tuple(t.shape) != tuple(dst.shape):
                    raise ValueError(f"torch engine ({self.fmt} weights): {name!r} has shape {tuple(dst.shape)}, "
                                     f"got {tuple(t.shape)}")
                dst.copy_(t)
            elif entry is not None:
                entry[0].quantize_into(entry[1], t)
            else:
                rest.append((name, t))
        return rest
