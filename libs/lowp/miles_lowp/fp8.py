"""Blockwise FP8 (e4m3), the DeepSeek-V3 layout: weights in 128x128 blocks with one float32 scale
each (``weight ≈ fp8 * weight_scale_inv``, Hugging Face's naming), activations in 1x128 groups
(one scale per token and 128 columns).

A GEMM ``a @ b.T`` whose operands are both quantized along the reduction dimension in groups of
``block`` (a 128x128 weight block is, row by row, such a group with the block's scale) is
:func:`grouped_mm`: on CUDA one blockwise-scaled ``torch._scaled_mm`` (1x128 x 128x128, or 1x128 x
1x128 where the 128x128 scale layout cuBLAS reads differs from the one torch checks, and for the
weight gradient; :func:`blockwise_operands`), or, where cuBLAS lacks that, one rowwise-scaled GEMM
per group, summed in float32; emulated (CPUs, or on request) it dequantizes both operands and
multiplies in float32: the same products, summed in another order.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK = 128
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 1e-12  # an all-zero block keeps a tiny scale and quantizes to zeros


def _fused(fn):
    """``fn`` on CUDA tensors through ``torch.compile`` (one fused kernel instead of about eight
    eager passes over the operand: the quantization dominated an FP8 training GEMM's time), eager
    elsewhere or where this torch cannot compile. Both compute the same IEEE float32 operations."""
    compiled: list = []

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not x.is_cuda or _EAGER:
            return fn(x, *args)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True))
        try:
            return compiled[0](x, *args)
        except Exception as e:  # no Triton / compiler here: eager from now on, said once
            import warnings

            warnings.warn(f"FP8 quantization runs eager (torch.compile failed: {type(e).__name__}: {e})",
                          stacklevel=2)
            _EAGER.add(True)
            return fn(x, *args)

    return run


_EAGER: set = set()  # non-empty once compiling failed in this process


def quantize_blockwise(w: torch.Tensor, block: int = BLOCK, halves: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, weight_scale_inv float32)`` of a 2-D weight ``[N, K]`` (scales ``[ceil(N/block),
    ceil(K/block)]``) or of 3-D expert weights ``[E, N, K]``, each expert on its own (scales ``[E,
    ceil(N/block), ceil(K/block)]``). ``halves=2`` blocks the two halves of ``N`` (a fused gate/up
    weight) separately: ``2 * ceil(N/2/block)`` scale rows. Edge blocks (shapes not multiples of
    ``block``) get their own scale from their own values."""
    if w.dim() not in (2, 3):
        raise ValueError(f"blockwise FP8 needs a 2-D weight or 3-D expert weights, got shape {tuple(w.shape)}")
    lead, (N, K) = w.shape[:-2], w.shape[-2:]
    if N % halves:
        raise ValueError(f"blockwise FP8: {N} rows do not split into {halves} halves")
    q, scale = _quantize(w.detach().reshape(-1, N // halves, K), block)
    return q.reshape(w.shape), scale.reshape(*lead, halves * scale.shape[-2], scale.shape[-1])


@_fused
def _quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise e4m3 of ``x [G, N, K]``: one scale per (matrix, block)."""
    G, N, K = x.shape
    nb, kb = -(-N // block), -(-K // block)
    padded = F.pad(x.float(), (0, kb * block - K, 0, nb * block - N))
    blocks = padded.view(G, nb, block, kb, block)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=_TINY) / E4M3_MAX
    q = (blocks / scale[:, :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(G, nb * block, kb * block)[:, :N, :K].contiguous(), scale


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: int = BLOCK, halves: int = 1) -> torch.Tensor:
    """The weight ``q * scale_inv`` (each scale repeated over its block), in ``dtype``; the
    inverse layout of :func:`quantize_blockwise` (2-D or 3-D, ``halves`` as there)."""
    N, K = q.shape[-2:]
    x = q.reshape(-1, N // halves, K)
    s = scale_inv.reshape(x.shape[0], -1, scale_inv.shape[-1])
    n = N // halves
    if n % block == 0 and K % block == 0:  # whole blocks: the scales broadcast, none repeated in memory
        blocks = x.float().view(x.shape[0], n // block, block, K // block, block) * s[:, :, None, :, None]
        return blocks.to(dtype).reshape(q.shape)
    full = s.repeat_interleave(block, -2)[:, :n].repeat_interleave(block, -1)[:, :, :K]
    return (x.float() * full).to(dtype).reshape(q.shape)


def quantize_groups(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 [..., K], scale float32 [..., ceil(K/block)])``: each row of ``x`` in groups of
    ``block`` columns with one scale each (1x128 activations); the edge group is zero-padded."""
    # one 2-D, grad-free operand: the compiled kernel is not recompiled per rank or autograd flag
    # (past torch's recompile limit it would run eager)
    q, scale = _quantize_groups(x.detach().reshape(-1, x.shape[-1]), block)
    return q.view(*x.shape[:-1], q.shape[-1]), scale.view(*x.shape[:-1], scale.shape[-1])


@_fused
def _quantize_groups(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    K = x.shape[-1]
    G = -(-K // block)
    xg = F.pad(x.float(), (0, G * block - K)).unflatten(-1, (G, block))
    scale = xg.abs().amax(-1).clamp(min=_TINY) / E4M3_MAX
    q = (xg / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :K].contiguous(), scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` for :func:`quantize_groups`' layout (also MX's, whose scales are powers of 2)."""
    K = q.shape[-1]
    if K % block == 0:  # whole groups: the scales broadcast, none repeated in memory
        return (q.float().unflatten(-1, (K // block, block)) * scale[..., None]).to(dtype).flatten(-2)
    return (q.float() * scale.repeat_interleave(block, -1)[..., :K]).to(dtype)


def block_row_scales(scale_inv: torch.Tensor, rows: int, block: int = BLOCK) -> torch.Tensor:
    """``[rows, K blocks]``: a 128x128-blocked weight's scales as per-row group scales (each row
    of a block shares the block's scale), the layout :func:`grouped_mm` takes."""
    return scale_inv.float().repeat_interleave(block, 0)[:rows]


def grouped_mm(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor, block: int = BLOCK,
               emulate: bool | None = None, out_dtype: torch.dtype = torch.float32,
               sb_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T`` for ``a = aq [M, K] * sa [M, G]`` and ``b = bq [N, K] * sb [N, G]``, both fp8 in
    groups of ``block`` along ``K`` (``sb_blocks``: ``b``'s 128x128 block scales, when it has them).
    ``emulate`` (default: not on CUDA) dequantizes and multiplies in float32; on CUDA one
    blockwise-scaled ``torch._scaled_mm`` where cuBLAS has it (Hopper, CUDA >= 12.9), else one
    rowwise-scaled GEMM per group, summed in float32."""
    if emulate is None:
        emulate = not aq.is_cuda
    if emulate:
        return (dequantize_groups(aq, sa, block) @ dequantize_groups(bq, sb, block).t()).to(out_dtype)
    if block == BLOCK and aq.is_cuda and _BLOCKWISE.get(aq.device.index, True):
        try:
            return _blockwise(aq, sa, bq, sb, sb_blocks).to(out_dtype)  # bf16 -> out_dtype: exact
        except torch.cuda.OutOfMemoryError:  # not a missing feature
            raise
        except (RuntimeError, ValueError):  # this torch / cuBLAS has no blockwise scaling (torch's
            _BLOCKWISE[aq.device.index] = False  # checks raise either): the group loop
    return _scaled_groups(aq, sa, bq, sb, block).to(out_dtype)


_BLOCKWISE: dict[int | None, bool] = {}


def blockwise_operands(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor,
                       sb_blocks: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """``(a [Mp, Kp], b [Kp, Np], scale_a, scale_b, recipe)``: the arguments of the one cuBLAS
    blockwise-scaled ``torch._scaled_mm(a, b, scale_a, scale_b)`` giving :func:`grouped_mm`'s
    ``a @ b.T`` in its first ``[M, N]``. ``K`` is zero-padded to whole groups (``Kp = 128 G``),
    ``M`` and ``N`` to multiples of 16 (zero rows with scale 1; their outputs are dropped); ``b``
    is column-major, as cuBLAS wants its second operand.

    cuBLAS' scale layouts (the ``recipe``), for ``G`` groups along ``K``:

    * ``1x128`` (either operand, ``R`` rows): ``[R, G]`` float32, outer-dim-major (strides
      ``(1, R)``); for ``b`` torch takes its transpose, ``[G, Np]`` row-major.
    * ``128x128`` (``b`` only here): ``[G, ceil(N/128)]`` with strides ``(1, L)``, where cuBLAS reads
      ``L = round_up(G, 4)`` floats per 128-row block. ``torch._scaled_mm``'s check accepts (and
      passes on) ``L = G`` only, so for ``G % 4 != 0`` cuBLAS would take every block row but the first's
      scales from the wrong place (silently: garbage results). There, and wherever ``b`` has no
      block scales, ``b`` goes as 1x128 groups with its per-row scales ``sb`` (a 128x128 block's
      rows share its scale: the same numbers): cuBLAS' 1x128 x 1x128, which also serves the weight
      gradient (two activation-like operands)."""
    (M, K), N = aq.shape, bq.shape[0]
    G, Mp, Np = -(-K // BLOCK), -(-M // 16) * 16, -(-N // 16) * 16

    def pad(q: torch.Tensor, rows: int) -> torch.Tensor:  # 0 is e4m3's +0.0
        if G * BLOCK == K and rows == q.shape[0]:
            return q  # a copy of the operand saved
        return F.pad(q.view(torch.uint8), (0, G * BLOCK - K, 0, rows - q.shape[0])).view(torch.float8_e4m3fn)

    scale_a = F.pad(sa.float(), (0, 0, 0, Mp - M), value=1.0).t().contiguous().t()  # [Mp, G], strides (1, Mp)
    if sb_blocks is not None and G % 4 == 0 and tuple(sb_blocks.shape) == (-(-N // BLOCK), G):
        scale_b = sb_blocks.float().contiguous().t()  # [G, N/128], strides (1, G), G == round_up(G, 4)
        recipe = "1x128 x 128x128"
    else:
        scale_b = F.pad(sb.float(), (0, 0, 0, Np - N), value=1.0).t().contiguous()  # [G, Np], strides (Np, 1)
        recipe = "1x128 x 1x128"
    return pad(aq, Mp), pad(bq, Np).t(), scale_a, scale_b, recipe


def _blockwise(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor,
               sb_blocks: torch.Tensor | None) -> torch.Tensor:
    """One cuBLAS GEMM with DeepSeek-V3's scaling (:func:`blockwise_operands`), bfloat16 out (the
    caller casts once to its dtype: no float32 copy of the product)."""
    a, b, scale_a, scale_b, _ = blockwise_operands(aq, sa, bq, sb, sb_blocks)
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return out[:aq.shape[0], :bq.shape[0]]


def _scaled_groups(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor,
                   block: int) -> torch.Tensor:
    """One rowwise-scaled FP8 GEMM per ``block``-column group. CUDA's rowwise scaling wants ``K``
    and ``N`` multiples of 16, a column-major second operand, float32 scales ``[M, 1]`` and ``[1,
    N]`` and a bfloat16 output, and cuBLAS refuses row counts whose scale vectors are not 16-byte
    aligned: edge groups are zero-padded to a full block, ``M`` and ``N`` to multiples of 16 (zeros
    add nothing; the padded outputs are dropped). CPU takes the same layout."""
    (M, K), N = aq.shape, bq.shape[0]
    G, Mp, Np = -(-K // block), -(-M // 16) * 16, -(-N // 16) * 16
    out_dtype = torch.bfloat16 if aq.is_cuda else torch.float32

    def groups(q: torch.Tensor, rows: int) -> torch.Tensor:  # [G, rows, block], 0 is e4m3's +0.0
        b = F.pad(q.view(torch.uint8), (0, G * block - K, 0, rows - q.shape[0]))
        return b.view(rows, G, block).transpose(0, 1).contiguous().view(torch.float8_e4m3fn)

    ag, bg = groups(aq, Mp), groups(bq, Np)
    sa = F.pad(sa.float(), (0, 0, 0, Mp - M), value=1.0).t().contiguous()  # [G, Mp]
    sb = F.pad(sb.float(), (0, 0, 0, Np - N), value=1.0).t().contiguous()  # [G, Np]
    acc = torch.zeros(Mp, Np, dtype=torch.float32, device=aq.device)
    for g in range(G):
        acc += torch._scaled_mm(ag[g], bg[g].t(), scale_a=sa[g].unsqueeze(1), scale_b=sb[g].unsqueeze(0),
                                out_dtype=out_dtype).float()
    return acc[:M, :N]


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 GEMMs with rowwise scales: CUDA devices of compute capability >= 8.9, and CPU where this
    torch's kernel takes rowwise scales (2.13 does; older ones take one scale per tensor only)."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu" and _cpu_rowwise()


@functools.cache
def _cpu_rowwise() -> bool:
    """Whether CPU ``torch._scaled_mm`` accepts rowwise scales (tried once on a 16x16 product)."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK,
               emulate: bool = False) -> torch.Tensor:
    """``x [T, K] @ W.T`` for the blockwise FP8 weight ``W = q [N, K] * scale_inv``: ``x`` is
    quantized per token and ``block``-column group, then :func:`grouped_mm` (``torch._scaled_mm``
    unless ``emulate``)."""
    xq, sx = quantize_groups(x, block)
    out = grouped_mm(xq, sx, q, block_row_scales(scale_inv, q.shape[0], block), block, emulate,
                     sb_blocks=scale_inv if block == BLOCK else None)
    return out.to(x.dtype)
