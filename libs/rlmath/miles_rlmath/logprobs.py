"""Log-probabilities of chosen tokens from a language model's logits, without materialising a
float32 copy of the logits.

``token_logprobs(logits [B, S, V], targets [B, R], temperature, index [B, R], vocab)`` returns
``[B, R]`` float32: ``log softmax(logits[b, index[b, r]] / temperature)[targets[b, r]]``, with the
vocabulary's columns at or past ``vocab`` left out (padding rows of a split embedding).

On CUDA with Triton the forward is one pass over each selected row (an online log-sum-exp in
float32 registers, reading the logits in their own dtype, bfloat16 under mixed precision) and
the backward one more pass writing ``(onehot - softmax) * grad / temperature`` in that dtype:
two reads and one write of the logits, where the plain formula (cast to float32, subtract the max,
exponentiate, sum, gather; then the same chain backwards) moves a float32 copy of the
``[B, R, V]`` logits a dozen times. With a 152k vocabulary and 1k-token rows that chain takes about
a quarter of a small model's training step. Elsewhere (CPU, no Triton) it is that plain formula,
bit for bit what the trainers compute on CPU.
"""
from __future__ import annotations

import functools

import torch

BLOCK = 4096  # vocabulary columns a program reads at a time (fp32 registers: 16 KiB a warp group)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   index: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor:
    """See the module docstring. ``index`` None: position ``r`` of every row (``S == R``)."""
    B, S, V = logits.shape
    R = targets.shape[1]
    vocab = V if vocab is None else vocab
    if logits.is_cuda and _kernels() is not None:
        if index is None:
            index = torch.arange(R, device=logits.device).expand(B, R)
        if logits.stride(2) != 1:
            logits = logits.contiguous()
        return _Fused.apply(logits, index, targets, float(temperature), vocab)
    if index is not None:
        logits = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, V))
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if vocab < V:
        x = x.masked_fill(torch.arange(V, device=x.device) >= vocab, float("-inf"))
    return x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


def fused_available(device: torch.device | str) -> bool:
    """Whether :func:`token_logprobs` takes the fused path for logits on ``device``."""
    return torch.device(device).type == "cuda" and _kernels() is not None


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, index, targets, temperature, vocab):  # noqa: ANN001, ANN205
        fwd, _ = _kernels()
        B, S, V = logits.shape
        R = targets.shape[1]
        rows = index.reshape(-1).to(torch.int64).contiguous()
        tgt = targets.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(B * R, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        if B * R:
            fwd[(B * R,)](logits, logits.stride(0), logits.stride(1), rows, tgt, out, lse, R, vocab,
                          1.0 / temperature, BLOCK=min(BLOCK, _pow2(vocab)), num_warps=8)
        ctx.save_for_backward(logits, rows, tgt, lse)
        ctx.shape, ctx.temperature, ctx.vocab = (B, R), temperature, vocab
        return out.view(B, R)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        _, bwd = _kernels()
        logits, rows, tgt, lse = ctx.saved_tensors
        B, R = ctx.shape
        V = logits.shape[2]
        dx = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)  # unselected rows: 0
        if B * R:
            bwd[(B * R,)](logits, logits.stride(0), logits.stride(1), dx, dx.stride(0), dx.stride(1),
                          rows, tgt, lse, grad.reshape(-1).float().contiguous(), R, V, ctx.vocab,
                          1.0 / ctx.temperature, BLOCK=min(BLOCK, _pow2(V)), num_warps=8)
        return dx, None, None, None, None


def _pow2(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


@functools.cache
def _kernels():  # noqa: ANN202
    """The two Triton kernels, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def fwd(x, sxb, sxs, rows, tgt, out, lse_out, R, vocab, inv_t, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        base = x + (i // R).to(tl.int64) * sxb + tl.load(rows + i) * sxs
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max and sum of exp
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, v)
            seen = m_new > float("-inf")  # a lane that has seen no column yet adds nothing
            acc = tl.where(seen, acc * tl.exp(m - m_new) + tl.exp(v - m_new), 0.0)
            m = m_new
        top = tl.max(m, 0)
        total = tl.sum(tl.where(m > float("-inf"), acc * tl.exp(m - top), 0.0), 0)
        lse = top + tl.log(total)
        picked = tl.load(base + tl.load(tgt + i)).to(tl.float32) * inv_t
        tl.store(out + i, picked - lse)
        tl.store(lse_out + i, lse)

    @triton.jit
    def bwd(x, sxb, sxs, dx, sdb, sds, rows, tgt, lse_in, g_in, R, V, vocab, inv_t, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        b = (i // R).to(tl.int64)
        s = tl.load(rows + i)
        src, dst = x + b * sxb + s * sxs, dx + b * sdb + s * sds
        lse, t, g = tl.load(lse_in + i), tl.load(tgt + i), tl.load(g_in + i) * inv_t
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(src + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
            d = tl.where(cols == t, g, 0.0) - g * tl.exp(v - lse)
            tl.store(dst + cols, d.to(dx.dtype.element_ty), mask=cols < V)

    return fwd, bwd
