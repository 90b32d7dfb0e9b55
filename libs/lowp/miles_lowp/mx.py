"""MXFP8 (OCP Microscaling Formats v1.0, the E4M3 element type): 32 consecutive elements along the
reduction dimension share one power-of-two scale stored as E8M0 (an unbiased exponent in
[-127, 127], biased by 127 in one byte; 0xFF is NaN and never written here).

Scale of a block (spec section 6.3): ``X = 2^(floor(log2(amax)) - emax_elem)`` with
``emax_elem = 8`` for E4M3 (its largest power of two, 256); each element is ``v / X`` cast to E4M3
with round-to-nearest-even, saturating at ±448 (the spec leaves overflow to the implementation; a
block's amax can reach 448 * 2 > 448 only through that rounding). An all-zero block gets the
smallest scale. Hopper and CPUs have no MX tensor cores, so these numerics are emulated exactly:
quantize-dequantize, then a float32 GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import E4M3_MAX, dequantize_groups

MX_BLOCK = 32
E4M3_EMAX = 8  # floor(log2(448))
E8M0_BIAS = 127


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """``floor(log2(amax)) - 8`` as int32 (exact: from the float's own exponent), clamped to E8M0's
    [-127, 127]; -127 for an all-zero block."""
    _, e = torch.frexp(amax.float())  # amax = m * 2^e with m in [0.5, 1): floor(log2) = e - 1
    x = (e - 1 - E4M3_EMAX).to(torch.int32)
    return torch.where(amax > 0, x, torch.full_like(x, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize_mx(x: torch.Tensor, block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [..., K], scale uint8 [..., ceil(K/block)])``: each row of ``x`` in blocks of
    ``block`` along its last dimension; the scales are biased E8M0 bytes (``2^(byte - 127)``)."""
    K = x.shape[-1]
    G = -(-K // block)
    xg = F.pad(x.float(), (0, G * block - K)).unflatten(-1, (G, block))
    exp = scale_exponent(xg.abs().amax(-1))
    q = torch.ldexp(xg, -exp[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :K].contiguous(), (exp + E8M0_BIAS).to(torch.uint8)


def scales(biased: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``2^(byte - 127)`` of E8M0 bytes."""
    return torch.ldexp(torch.ones(biased.shape, device=biased.device), biased.to(torch.int32) - E8M0_BIAS)


def dequantize_mx(q: torch.Tensor, biased: torch.Tensor, block: int = MX_BLOCK,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * 2^(scale - 127)`` blockwise, in ``dtype``."""
    return dequantize_groups(q, scales(biased), block, dtype)


def qdq_mx(x: torch.Tensor, block: int = MX_BLOCK) -> torch.Tensor:
    """``x`` rounded to MXFP8 and back, in ``x``'s dtype."""
    return dequantize_mx(*quantize_mx(x, block), block, x.dtype)
