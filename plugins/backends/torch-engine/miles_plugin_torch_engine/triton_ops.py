"""Fused Triton kernels for the fast path's decode step on CUDA.

A decode step of a 0.5B model at batch 256 is mostly small element-wise work between the GEMMs;
inside a CUDA graph every kernel still costs a few microseconds, so an unfused step (about 35
kernels a layer: RMSNorm alone is eight) spends more time on kernel boundaries than on math.
These kernels cut a layer to about ten: residual add + RMSNorm, RoPE of q and k + the KV-cache
write, SiLU-gate * up, and attention over each row's own cache positions (a masked SDPA over the
whole length bucket took 2.3x as long); prefill uses the first and third. Sampling reads the
logits once, in two kernels. Each keeps Hugging Face's rounding steps (the bf16 products of RoPE are
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
                           D: tl.constexpr, T: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)  # query row; its cache row is b // T
        j = tl.program_id(1)
        slot = b // T
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
                tl.store(k_ptr + slot * s_slot + (j - H) * s_head + p * s_pos + d, y)
        else:
            tl.store(v_ptr + slot * s_slot + (j - H - KV) * s_head + p * s_pos + d, x)

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


    @triton.jit
    def _lse_parts_kernel(logits_ptr, m_ptr, s_ptr, V, S, temp, BLOCK: tl.constexpr):
        """One (row, block of BLOCK tokens) of ``x = logits / T``: the block's max and sum of
        ``exp(x - max)``, the parts of the row's log-sum-exp and of its cumulative distribution."""
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temp
        top = tl.max(x, axis=0)
        tl.store(m_ptr + row * S + blk, top)
        tl.store(s_ptr + row * S + blk, tl.sum(tl.exp(x - top), axis=0))

    @triton.jit
    def _draw_kernel(logits_ptr, m_ptr, s_ptr, seed_ptr, tok_ptr, logp_ptr, V, S, temp,
                     BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, GREEDY: tl.constexpr):
        """One row: an inverse-CDF draw (one uniform ``U``: the block whose cumulative mass passes
        ``U * total``, then the token inside it whose does), or the first argmax when greedy; and
        the token's log-prob ``x_tok - logsumexp(x)``."""
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_S)
        tops = tl.load(m_ptr + row * S + j, mask=j < S, other=float("-inf"))
        top = tl.max(tops, axis=0)
        mass = tl.load(s_ptr + row * S + j, mask=j < S, other=0.0) * tl.exp(tops - top)
        total = tl.sum(mass, axis=0)
        if GREEDY:
            blk = tl.argmax(tops, axis=0)
        else:
            target = tl.rand(tl.load(seed_ptr), row.to(tl.int32)) * total
            below = tl.cumsum(mass, axis=0) <= target  # blocks wholly below the target
            blk = tl.minimum(tl.sum(below.to(tl.int32), axis=0), S - 1)
            target -= tl.sum(tl.where(j < blk, mass, 0.0), axis=0)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temp
        if GREEDY:
            k = tl.argmax(x, axis=0)
        else:
            e = tl.exp(x - top)
            k = tl.sum((tl.cumsum(e, axis=0) <= target).to(tl.int32), axis=0)
            # rounding may leave the target past the block's sum: its last token of nonzero mass
            k = tl.minimum(k, tl.max(tl.where(e > 0, tl.arange(0, BLOCK), 0), axis=0))
        tok = blk * BLOCK + k
        xt = tl.load(logits_ptr + row * V + tok).to(tl.float32) / temp
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(logp_ptr + row, xt - (top + tl.log(total)))

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, scale, s_slot, s_head, s_pos,
                                 G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                                 BLOCK_N: tl.constexpr, IEEE: tl.constexpr, T: tl.constexpr):
        """One (row, KV head): its ``G`` query heads (padded to ``GP`` rows for ``tl.dot``) over
        cache positions ``<= pos[row]`` in blocks of ``BLOCK_N``, with an online softmax (float32
        scores and sums; probabilities cast to the cache dtype for the product with V, as flash
        attention does). Head dims below 16 (``tl.dot``'s least) are zero-padded to ``DP``."""
        b = tl.program_id(0).to(tl.int64)
        kv = tl.program_id(1)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        n = tl.arange(0, BLOCK_N)
        rows = (b * (tl.num_programs(1) * G) + kv * G + g)[:, None] * D + d[None, :]
        q_mask = (g < G)[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + rows, mask=q_mask, other=0.0)
        base = (b // T) * s_slot + kv * s_head  # T query rows per cache row
        end = tl.load(pos_ptr + b) + 1
        top = tl.full((GP,), float("-inf"), tl.float32)
        total = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, DP), tl.float32)
        precision: tl.constexpr = "ieee" if IEEE else "tf32"
        for start in range(0, end, BLOCK_N):
            at = start + n
            live = at < end
            offs = base + at[:, None] * s_pos + d[None, :]
            kv_mask = live[:, None] & (d < D)[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=precision) * scale
            sc = tl.where(live[None, :], sc, float("-inf"))
            new_top = tl.maximum(top, tl.max(sc, axis=1))
            p = tl.exp(sc - new_top[:, None])
            keep = tl.exp(top - new_top)
            total = total * keep + tl.sum(p, axis=1)
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
            acc = acc * keep[:, None] + tl.dot(p.to(v.dtype), v, input_precision=precision)
            top = new_top
        tl.store(o_ptr + rows, (acc / total[:, None]).to(o_ptr.dtype.element_ty), mask=q_mask)

def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, norm) -> torch.Tensor:
    """``h += delta`` (in place, when given), then HF's RMSNorm of ``h``; ``h`` is ``[B, N]``."""
    B, N = h.shape
    out = torch.empty_like(h)
    _add_rms_norm_kernel[(B,)](h, h if delta is None else delta, norm.weight, out,
                               norm.variance_epsilon, N, BLOCK=triton.next_power_of_2(N),
                               ADD=delta is not None)
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
               per_row: int = 1) -> torch.Tensor:
    """Rotate q and k of ``qkv [B, H + 2 KV, D]`` at ``pos``; write k and v into the layer's cache
    ``[slots, KV, L, D]`` at (row b, ``pos[b]``); return the rotated q ``[B, H, D]``. ``per_row``
    tokens per cache row (a speculative verify block): token b goes to row ``b // per_row``."""
    B, _, D = qkv.shape
    q = torch.empty((B, heads, D), dtype=qkv.dtype, device=qkv.device)
    s_slot, s_head, s_pos, _ = k_cache.stride()
    _rope_store_kernel[(B, heads + 2 * kv_heads)](qkv, cos, sin, pos, q, k_cache, v_cache, s_slot,
                                                  s_head, s_pos, H=heads, KV=kv_heads, D=D, T=per_row)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` (``[B, 2 I]``)."""
    B, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((B, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(B, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


SAMPLE_BLOCK = 4096


def sample(logits: torch.Tensor, temperature: float, seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` from ``softmax(logits / T)`` and its log-prob
    (float32), in two kernels: per block of the vocabulary the log-sum-exp parts (the one full
    read of the logits), then per row an inverse-CDF draw that reads only the chosen block.
    ``seed``: a device int tensor ``[1]`` (drawn from the engine's generator: no host sync);
    None: greedy."""
    B, V = logits.shape
    S = triton.cdiv(V, SAMPLE_BLOCK)
    f32 = dict(dtype=torch.float32, device=logits.device)
    tops, mass, logp = torch.empty((B, S), **f32), torch.empty((B, S), **f32), torch.empty(B, **f32)
    tok = torch.empty(B, dtype=torch.long, device=logits.device)
    if B == 0:
        return tok, logp
    temp = 1.0 if seed is None else float(temperature)  # as the torch path: logits.float() / T
    logits = logits.contiguous()
    _lse_parts_kernel[(B, S)](logits, tops, mass, V, S, temp, BLOCK=SAMPLE_BLOCK)
    _draw_kernel[(B,)](logits, tops, mass, tok if seed is None else seed, tok, logp, V, S, temp,
                       BLOCK=SAMPLE_BLOCK, BLOCK_S=triton.next_power_of_2(S), GREEDY=seed is None)
    return tok, logp


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     scale: float, per_row: int = 1) -> torch.Tensor:
    """Attention of one query position per row: ``q [B, H, D]`` over the layer's cache
    ``[slots, KV, L, D]`` rows ``0..B-1`` at positions ``<= pos[b]``; returns ``[B, H, D]``. Reads
    only each row's own positions (SDPA with a mask reads the whole bucket). ``per_row`` queries per
    cache row (a speculative verify block, each at its own position): query b reads row ``b // per_row``."""
    B, H, D = q.shape
    KV = k_cache.shape[1]
    out = torch.empty_like(q)
    s_slot, s_head, s_pos, _ = k_cache.stride()
    _decode_attention_kernel[(B, KV)](q, k_cache, v_cache, pos, out, scale, s_slot, s_head, s_pos,
                                      G=H // KV, GP=max(16, triton.next_power_of_2(H // KV)), D=D,
                                      DP=max(16, triton.next_power_of_2(D)), BLOCK_N=64,
                                      IEEE=q.dtype == torch.float32, T=per_row)
    return out
