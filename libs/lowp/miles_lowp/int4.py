"""INT4 weight-only quantization (W4A16), as INT4 quantization-aware RL trains and serves it:
symmetric, one float32 scale per ``group`` (128) consecutive weights of a row (``scale = amax /
7``, values ``round(w / scale)`` clamped to [-8, 7], ties to even), packed two a byte.

Packing (``weight_packed`` ``uint8 [..., K/2]``): value ``2i`` in the low nibble, ``2i + 1`` in the
high one, each stored as ``v + 8`` (0..15). Scales: ``weight_scale`` ``float32 [..., ceil(K/group)]``.
Works on 2-D linear weights and on 3-D expert weights alike (rows are the leading dimensions).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

INT4_GROUP = 128
QMAX = 7
QMIN = -8
_TINY = 1e-12


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 values in [-8, 7] [..., K], scale float32 [..., ceil(K/group)])``."""
    K = w.shape[-1]
    G = -(-K // group)
    wg = F.pad(w.float(), (0, G * group - K)).unflatten(-1, (G, group))
    scale = wg.abs().amax(-1).clamp(min=_TINY) / QMAX
    q = torch.round(wg / scale[..., None]).clamp(QMIN, QMAX).to(torch.int8)
    return q.flatten(-2)[..., :K].contiguous(), scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, group: int = INT4_GROUP,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` groupwise, in ``dtype``."""
    K = q.shape[-1]
    if K % group == 0:  # whole groups: the scales broadcast, none repeated in memory
        return (q.float().unflatten(-1, (K // group, group)) * scale.float()[..., None]).to(dtype).flatten(-2)
    return (q.float() * scale.float().repeat_interleave(group, -1)[..., :K]).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two INT4 values a byte (see the module doc); the last dimension must be even."""
    if q.shape[-1] % 2:
        raise ValueError(f"INT4 packing needs an even number of columns, got {q.shape[-1]}")
    u = (q.to(torch.int16) - QMIN).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The int8 values of :func:`pack_int4` (``[..., 2 * packed.shape[-1]]``)."""
    lo = (packed & 0x0F).to(torch.int8) + QMIN
    hi = (packed >> 4).to(torch.int8) + QMIN
    return torch.stack([lo, hi], -1).flatten(-2)


def quantize_packed(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight_packed uint8, weight_scale float32)`` of a weight."""
    q, scale = quantize_int4(w, group)
    return pack_int4(q), scale


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, group: int = INT4_GROUP,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight that :func:`quantize_packed` stands for, in ``dtype``."""
    return dequantize_int4(unpack_int4(packed), scale, group, dtype)


def qdq_int4(w: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """``w`` rounded to INT4 and back, in ``w``'s dtype."""
    return dequantize_int4(*quantize_int4(w, group), group, w.dtype)


def fake_int4(w: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Quantization-aware training's weight: the INT4-rounded values forward, the identity
    backward (straight-through estimator), so the full-precision master weights keep learning
    from gradients taken at the weights the engine serves."""
    return w + (qdq_int4(w.detach(), group) - w).detach()
