"""Fused Triton kernels for the fast path's decode step on CUDA.

A decode step of a 0.5B model at batch 256 is mostly small element-wise work between the GEMMs;
inside a CUDA graph every kernel still costs a few microseconds, so an unfused step (about 35
kernels a layer: RMSNorm alone is eight) spends more time on kernel boundaries than on math.
These kernels cut a layer to about ten: residual add + RMSNorm, RoPE of q and k + the KV-cache
write, and SiLU-gate * up. Each keeps Hugging Face's rounding steps (the bf16 products of RoPE are
rounded before they are summed, RMSNorm rounds before the weight multiply), so the numbers are
those of the trainer's forward up to reduction order.

Triton ships with CUDA builds of torch; without it (or on CPU) the fast path uses plain torch ops.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(h_ptr, delta_ptr, w_ptr, out_ptr, eps, N, BLOCK: tl.constexpr,
                             ADD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        h = tl.load(h_ptr + row * N + cols, mask=m, other=0.0)
        if ADD:  # the residual add, rounded to the model dtype as torch's add is
            d = tl.load(delta_ptr + row * N + cols, mask=m, other=0.0)
            h = (h.to(tl.float32) + d.to(tl.float32)).to(h.dtype)
            tl.store(h_ptr + row * N + cols, h, mask=m)
        x = h.to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        y = (x * tl.rsqrt(var + eps)).to(h.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, (w * y).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
                           s_slot, s_head, s_pos, H: tl.constexpr, KV: tl.constexpr,
                           D: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        d = tl.arange(0, D)
        row = qkv_ptr + (b * (H + 2 * KV) + j) * D
        x = tl.load(row + d)
        p = tl.load(pos_ptr + b).to(tl.int64)
        if j < H + KV:
            rolled = tl.load(row + (d + D // 2) % D)
            c = tl.load(cos_ptr + p * D + d).to(tl.float32)
            s = tl.load(sin_ptr + p * D + d).to(tl.float32)  # sign of rotate_half folded in
            a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
            r = (rolled.to(tl.float32) * s).to(x.dtype).to(tl.float32)
            y = (a + r).to(x.dtype)
            if j < H:
                tl.store(q_ptr + (b * H + j) * D + d, y)
            else:
                tl.store(k_ptr + b * s_slot + (j - H) * s_head + p * s_pos + d, y)
        else:
            tl.store(v_ptr + b * s_slot + (j - H - KV) * s_head + p * s_pos + d, x)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=m, other=0.0)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (act * u).to(g.dtype), mask=m)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, norm) -> torch.Tensor:
    """``h += delta`` (in place, when given), then HF's RMSNorm of ``h``; ``h`` is ``[B, N]``."""
    B, N = h.shape
    out = torch.empty_like(h)
    _add_rms_norm_kernel[(B,)](h, h if delta is None else delta, norm.weight, out,
                               norm.variance_epsilon, N, BLOCK=triton.next_power_of_2(N),
                               ADD=delta is not None)
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Rotate q and k of ``qkv [B, H + 2 KV, D]`` at ``pos``; write k and v into the layer's cache
    ``[slots, KV, L, D]`` at (row b, ``pos[b]``); return the rotated q ``[B, H, D]``."""
    B, _, D = qkv.shape
    q = torch.empty((B, heads, D), dtype=qkv.dtype, device=qkv.device)
    s_slot, s_head, s_pos, _ = k_cache.stride()
    _rope_store_kernel[(B, heads + 2 * kv_heads)](qkv, cos, sin, pos, q, k_cache, v_cache, s_slot,
                                                  s_head, s_pos, H=heads, KV=kv_heads, D=D)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` (``[B, 2 I]``)."""
    B, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((B, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(B, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
