"""The W4A16 GEMM of ``engine.weights_dtype: int4`` on CUDA: a Triton kernel that reads the packed
INT4 weights (two a byte, one scale per 128 of a row: ``miles_lowp.int4``) and dequantizes each
128-column group in registers right before its tile product, so the weights cross memory at a
quarter of their bf16 size and no dequantized copy is ever written. Decode is memory-bound, which
is where that pays.

Each group's weights become ``(value * scale)`` rounded to the activations' dtype, exactly the
weights the trainer's QAT forward multiplies by; products accumulate in float32.
"""
from __future__ import annotations

import functools

import torch

GROUP = 128


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def w4a16(x_ptr, p_ptr, s_ptr, y_ptr, M, N, K, sxm, sxk, spn, spk, ssn, ssg, sym, syn,
              BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, IEEE: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, G)
        rh = tl.arange(0, G // 2)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for g in range(0, K // G):
            x = tl.load(x_ptr + rm[:, None] * sxm + (g * G + rk)[None, :] * sxk, mask=rm[:, None] < M, other=0.0)
            p = tl.load(p_ptr + rn[:, None] * spn + (g * (G // 2) + rh)[None, :] * spk, mask=rn[:, None] < N,
                        other=0).to(tl.int32)
            w = tl.interleave((p & 15) - 8, (p >> 4) - 8)  # [BN, G]: value 2i low nibble, 2i + 1 high
            s = tl.load(s_ptr + rn * ssn + g * ssg, mask=rn < N, other=0.0)
            wt = (w.to(tl.float32) * s[:, None]).to(x.dtype)
            if IEEE:
                acc += tl.dot(x, tl.trans(wt), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(wt))
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return w4a16


def supports(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether :func:`w4a16_linear` takes this call: CUDA, Triton, whole 128-column groups."""
    return x.is_cuda and available() and (2 * packed.shape[-1]) % GROUP == 0


def w4a16_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, block_n: int = 64,
                 num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """``x [..., K] @ W.T`` for ``W`` = the INT4 weight ``packed [N, K/2]`` with ``scale [N, K/128]``."""
    import triton

    x2 = x.reshape(-1, x.shape[-1])
    M, K = x2.shape
    N = packed.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    BM = 16 if M <= 16 else (32 if M <= 32 else 64)  # decode steps are a few rows
    scale = scale.float()
    _kernel()[(triton.cdiv(M, BM), triton.cdiv(N, block_n))](
        x2, packed, scale, y, M, N, K, x2.stride(0), x2.stride(1), packed.stride(0), packed.stride(1),
        scale.stride(0), scale.stride(1), y.stride(0), y.stride(1),
        BM=BM, BN=block_n, G=GROUP, IEEE=x.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    return y.reshape(*x.shape[:-1], N)
