"""The fast path on CPU (float32): prefill and decode steps in as few torch calls as the math
allows, and a scheduler whose per-step bookkeeping stays on the host.

On CPU a decode step of a small model is the GEMMs, attention over the cache, and a few
microseconds of dispatch per op whatever its size; HF's forward spends most of a step on the
latter. So a layer here is about 30 kernels, each in HF's own op order:

- RMSNorm is HF's float32 composite as seven kernels (bit-identical, checked once per width);
  q|k|v and gate|up are one GEMM each on engine-owned concatenated weights (made at every
  ``generate``, since the weights may have been replaced), in the GEMM library ``engine.cpu_gemm``
  picks (``miles_fastpath.cpu_gemm``): in oneDNN (AMD CPUs, layers of >= 512k weights) packed for
  it, with the residual adds inside the o/down GEMMs; in MKL packed on Intel CPUs for layers too
  big for L2, else stored ``[in, out]`` with those adds inside ``addmm`` (bit-identical to the
  separate add); see :class:`_Weight`.
- RoPE rotates q and k together (``x * cos + roll(x) * sin``, rotate_half's sign folded into sin).
- When every row sits at the same position (prompts of one length) the cache writes are slice
  copies and attention needs no mask; otherwise indexed writes and one additive mask per step.
- Decode attention is two batched GEMMs over (row, KV head) items, the query heads of a KV head
  as that item's query rows (GQA without copies), with the softmax between them in the op order
  of torch's CPU flash kernel (:func:`_attend`). Prefill keeps SDPA (one call per layer).
- Caches of ``fast.DIM_MAJOR_KEYS`` positions or more store keys dim-major, so q.k is a plain
  GEMM over contiguous positions: at long contexts decode attention streams the whole cache
  every step and is bound by memory bandwidth, and the q.k GEMM over position-major keys ran at
  half of it (the quickstart model, 256 rows x 128+256 tokens: generation 10% faster; 64 rows x
  64+128: 10-15%). Shorter caches keep keys position-major: there the strided write of each
  step's keys costs what the GEMM saves, or more (a 6-layer hidden-256 model, 128 rows x 6+32
  tokens: ~10% slower dim-major).
- With a small vocabulary (character/byte tokenizers), layer 0's q|k|v of every token id is a
  table made once per ``generate``: that layer's first norm and GEMM become a row lookup.
- The last prefill layer computes q, attention, o_proj and the MLP only at each prompt's last
  token (the other tokens only feed that layer's keys/values); prefill runs in cache-sized
  chunks of prompts.

Other formulations were measured and dropped. Slower: attention per row against all KV heads
(block-diagonal queries over position-major keys, or spans of the cache with a block mask),
which halves the GEMM items but multiplies their work by the KV heads; MKL-packed weights on
an AMD EPYC host (on an Intel Xeon they are faster: :func:`_mkl_packs`); attention as broadcast
multiplies and sums instead of batched GEMMs (2-4x slower at 8-64 positions).
Further from HF's forward (which the trainer recomputes): RoPE as one complex multiply or
``addcmul`` (fused multiply-adds), ``torch.softmax`` before the GEMM with V (normalising
before the sum instead of after, as the flash kernel does: the tests' worst log-prob deviation
8.6e-6 instead of 6.7e-6, against the 1e-5 they allow), and RMSNorm weights folded into the
next GEMM. As it is, greedy tokens equal the uncached reference and log-probs
stay within the tests' 1e-5 of a full HF forward (worst ~7e-6, as on the generic path).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from miles_fastpath import cpu_gemm

from . import cpu_workers
from .batching import FastGenerator
from .fast import LlamaFamilyForward, _rope
from .sampling import sample

TABLE_ELEMENTS = 1 << 22  # layer 0's q|k|v is tabled per token id below this many table entries
PREFILL_ELEMENTS = 1 << 19  # gate|up activations per prefill chunk (2 MiB in float32)
# A decode step is split among workers only when each worker's share of a layer's GEMMs is at least
# this many multiply-adds (and 8 rows): below it the slices' Python and dispatch, which take turns
# on the GIL, cost more than the second core gives. Measured on 2 cores (one intra-op thread vs two
# workers): the quickstart model (246k GEMM weights a layer) gains 1.2x at 64 rows a worker (16M)
# but loses at 32 (8M: 0.146 s vs 0.137 s for 64 rows x 64 tokens, and 0.154 s vs 0.085 s for 32);
# a 6-layer hidden-256 model (983k) gains 1.08x at 16 rows a worker (16M), 1.38x at 32.
SLICE_MACS = 12_000_000


def _mkl_packs() -> bool:
    """Whether the CPU steps may use MKL-packed weights (when ``engine.cpu_gemm`` resolves to MKL):
    torch built with MKL, on an Intel CPU. There, multiplying by weights MKL packed once per
    ``generate`` (instead of repacking each operand at every call) made a 6-layer hidden-256
    model's GEMMs at 64 rows ~20% faster (AVX-512 Xeon, one thread, each layer's weights cold in
    L3). On an AMD EPYC host they were slower, so elsewhere weights are stored ``[in, out]`` for
    ``mm`` (5-20% faster there than the transposed view)."""
    return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
            and cpu_gemm.cpu_vendor() == "GenuineIntel")


MKL_PACKED = _mkl_packs()
# ... for layers of at least this many weights: the gain is in streaming weights that no longer
# sit in L2 between steps. The quickstart model's layers (246k weights, 1 MiB) generated 5%
# slower packed (64 rows x 32+64 tokens), a 6-layer hidden-256 model's (983k) 5-10% faster.
PACK_ELEMENTS = 1 << 19


def layout(gemm: str, elements: int) -> str:
    """How a layer of ``elements`` weights is held for ``gemm`` (``miles_fastpath.cpu_gemm.resolve``'s
    answer): ``onednn`` (packed for oneDNN), ``mkl_packed`` or ``in_out``."""
    if gemm == "onednn":
        return "onednn"
    return "mkl_packed" if MKL_PACKED and elements >= PACK_ELEMENTS else "in_out"


class _Weight:
    """Linear weights ``[out, in]`` stacked (q|k|v, gate|up) as the CPU steps multiply by them, in
    a :func:`layout`: packed for oneDNN or for MKL, or one contiguous ``[in, out]`` copy for
    ``mm``. Made at every ``generate``, since the weights may have been replaced."""

    def __init__(self, *weights: torch.Tensor, layout: str):
        self.rows = torch.cat(weights) if len(weights) > 1 else weights[0].contiguous()  # [out, in]
        self.layout = layout
        # a pack serves any row count (the batch size given here only sizes the blocking)
        if layout == "onednn":
            self.w = cpu_gemm.pack(self.rows)
        elif layout == "mkl_packed":
            self.w = torch.ops.mkl._mkl_reorder_linear_weight(self.rows, 64)
        else:
            self.w = self.rows.t().contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.layout == "onednn":
            return cpu_gemm.linear(x, self.w, bias)
        if self.layout == "mkl_packed":
            return torch.ops.mkl._mkl_linear(x, self.w, self.rows, bias, x.shape[0])
        return torch.mm(x, self.w) if bias is None else torch.addmm(bias, x, self.w)

    def residual(self, h: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``h + x @ W.T (+ bias)``: the add inside the GEMM in oneDNN, and in ``addmm`` without bias."""
        if self.layout == "onednn":
            return cpu_gemm.linear_add(x, self.w, bias, h)
        if self.layout == "in_out" and bias is None:
            return torch.addmm(h, x, self.w)
        return self(x, bias).add_(h)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """Attention of one query position per row: ``q [B * KV, G, D]`` (the G query heads of each
    KV head are that head's query rows: GQA without repeating keys) over ``keys``/``values
    [B, KV, L, D]`` (cache views), with an additive ``mask [B, 1, 1, L]`` or None; returns
    ``[B * KV, G, D]``.

    Two batched GEMMs with the softmax between them in the op order of torch's CPU flash kernel,
    which HF's forward runs (scores scaled after q.k; ``exp(s - max)``; the output scaled by
    ``1 / sum`` after the GEMM with V). SDPA itself, at one query position, runs a parallel loop
    over (row, KV head) items of ~1-2 us each: no faster on one thread, and with two threads on
    shared cores its per-item loop stalls (~4x these ops at 128 rows x 4 KV heads)."""
    BKV, G, D = q.shape
    L = keys.shape[2]
    s = torch.bmm(q, keys.reshape(BKV, L, D).transpose(1, 2)).mul_(scale)
    if mask is not None:
        s.view(mask.shape[0], -1, G, L).add_(mask)
    p = s.sub_(s.amax(-1, keepdim=True)).exp_()
    return torch.bmm(p, values.reshape(BKV, L, D)).mul_(p.sum(-1, keepdim=True).reciprocal_())


def _hf_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's float32 RMSNorm."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class _Norm:
    """An HF RMSNorm in HF's float32 op order as seven kernels: ``x * x`` is ``pow(x, 2)``, the
    mean is the sum divided by the width, and width and eps are 0-dim tensors made once (a Python
    scalar costs a tensor conversion in every op; ``torch.rms_norm``'s CPU composite also copies
    for dtypes: ~1.5x the time at decode sizes). Checked bit for bit against HF's composite once
    per width, which is used instead should they ever differ."""

    exact: dict[int, bool] = {}

    def __init__(self, norm: Any):
        self.weight, self.eps_f = norm.weight, norm.variance_epsilon
        width = self.weight.shape[-1]
        self.width = torch.tensor(float(width), dtype=self.weight.dtype)
        self.eps = torch.tensor(self.eps_f, dtype=self.weight.dtype)
        if width not in _Norm.exact:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(7, width, generator=g, dtype=self.weight.dtype) * 3
            _Norm.exact[width] = torch.equal(self._lean(x), _hf_rms(x, self.weight, self.eps_f))

    def _lean(self, x: torch.Tensor) -> torch.Tensor:
        inv = torch.mul(x, x).sum(-1, keepdim=True).div_(self.width).add_(self.eps).rsqrt_()
        return torch.mul(x, inv).mul_(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if _Norm.exact[self.weight.shape[-1]]:
            return self._lean(x)
        return _hf_rms(x, self.weight, self.eps_f)


class _Layer:
    """One decoder layer's engine-owned weights (concatenated, held as ``gemm`` multiplies by them)."""

    def __init__(self, layer: Any, qk_norm: bool, gemm: str):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = _Norm(layer.input_layernorm), _Norm(layer.post_attention_layernorm)
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        linears = (*projs, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        kind = layout(gemm, sum(m.weight.numel() for m in linears))
        self.wqkv = _Weight(*(p.weight for p in projs), layout=kind)
        self.bqkv = torch.cat([p.bias for p in projs]) if attn.q_proj.bias is not None else None
        q_rows = attn.q_proj.out_features  # the q and k|v parts, for the last prefill layer
        self.wq, self.wkv = self.wqkv.rows[:q_rows], self.wqkv.rows[q_rows:]
        self.bq, self.bkv = (None, None) if self.bqkv is None else (self.bqkv[:q_rows], self.bqkv[q_rows:])
        self.wo, self.bo = _Weight(attn.o_proj.weight, layout=kind), attn.o_proj.bias
        gate, up = mlp.gate_proj, mlp.up_proj
        self.wgu = _Weight(gate.weight, up.weight, layout=kind)
        self.bgu = torch.cat([gate.bias, up.bias]) if gate.bias is not None else None
        self.wd, self.bd = _Weight(mlp.down_proj.weight, layout=kind), mlp.down_proj.bias
        self.inter = mlp.down_proj.in_features
        self.qk_norms = (_Norm(attn.q_norm), _Norm(attn.k_norm)) if qk_norm else None  # Qwen3
        self.table: torch.Tensor | None = None  # q|k|v per token id (layer 0, small vocabularies)

    def qkv(self, h: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        if self.table is not None:
            return torch.embedding(self.table, ids)
        return self.wqkv(self.norm1(h), self.bqkv)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gu = self.wgu(self.norm2(h), self.bgu)
        act = F.silu(gu.narrow(-1, 0, self.inter)).mul_(gu.narrow(-1, self.inter, self.inter))
        return self.wd.residual(h, act, self.bd)


class CpuForward:
    """Prefill and decode over the KV cache of a :class:`LlamaFamilyForward`; ``prepare`` before
    every ``generate``."""

    def __init__(self, fwd: LlamaFamilyForward, gemm: str = "mkl"):
        self.fwd, self.gemm = fwd, gemm  # gemm: "mkl" or "onednn" (``miles_fastpath.cpu_gemm.resolve``)
        self.layers: list[_Layer] = []
        self.min_slice_rows = 8  # rows a worker needs for a split decode step (set in ``prepare``)

    @torch.no_grad()
    def prepare(self) -> None:
        f = self.fwd
        self.layers = [_Layer(layer, f.qk_norm, self.gemm) for layer in f.inner.layers]
        self.norm = _Norm(f.inner.norm)
        self.lm_head = f.model.lm_head.weight.t()
        self.embed = f.inner.embed_tokens.weight
        if self.embed.shape[0] * self.layers[0].wqkv.rows.shape[0] <= TABLE_ELEMENTS:
            self.layers[0].table = self.layers[0].qkv(self.embed, None)
        lw = self.layers[0]
        self.min_slice_rows = max(8, -(-SLICE_MACS // sum(w.rows.numel() for w in (lw.wqkv, lw.wo, lw.wgu, lw.wd))))

    def _rotate(self, lw: _Layer, heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q ``[..., H, D]`` and k ``[..., KV, D]`` of ``heads [..., H + 2 KV, D]``."""
        H, KV = self.fwd.heads, self.fwd.kv_heads
        if lw.qk_norms is None:  # q and k in one go
            qk = _rope(heads.narrow(-2, 0, H + KV), cos, sin)
            return qk.narrow(-2, 0, H), qk.narrow(-2, H, KV)
        return (self._rotate_one(lw, 0, heads.narrow(-2, 0, H), cos, sin),
                self._rotate_one(lw, 1, heads.narrow(-2, H, KV), cos, sin))

    @staticmethod
    def _rotate_one(lw: _Layer, which: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """RoPE of q (``which`` 0) or k (1) heads, after Qwen3's norm of them."""
        return _rope(x if lw.qk_norms is None else lw.qk_norms[which](x), cos, sin)

    def decode(self, tok: torch.Tensor, pos: torch.Tensor | None, length: int, same_pos: int | None,
               out: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Logits ``[B, V]`` (into ``out``) of one token per cache row ``first..first+B-1``, fed at
        ``same_pos`` (a host int: every row there) or else at ``pos [B]``; attends to cache
        positions ``< length`` (and, with ``pos``, ``<= pos``)."""
        f = self.fwd
        B, H, KV, D = tok.shape[0], f.heads, f.kv_heads, f.head_dim
        ks, vs = f.k_cache.narrow(1, first, B), f.v_cache.narrow(1, first, B)  # [layers, B, KV, positions, D]
        keys, values = ks.narrow(3, 0, length).unbind(0), vs.narrow(3, 0, length).unbind(0)
        if same_pos is not None:
            cos, sin, mask = f.cos[same_pos], f.sin[same_pos], None
            k_new, v_new = ks.select(3, same_pos).unbind(0), vs.select(3, same_pos).unbind(0)
        else:
            cos, sin = f.cos[pos].unsqueeze(1), f.sin[pos].unsqueeze(1)
            at = (torch.arange(first, first + B), slice(None), pos)
            # additive, made once per step and added to every layer's scores
            mask = torch.zeros(B, 1, 1, length).masked_fill_(torch.arange(length) > pos.view(B, 1, 1, 1),
                                                             float("-inf"))
        h = torch.embedding(self.embed, tok)
        for li, lw in enumerate(self.layers):
            heads = lw.qkv(h, tok).view(B, H + 2 * KV, D)
            q, k = self._rotate(lw, heads, cos, sin)
            if mask is None:
                k_new[li].copy_(k)
                v_new[li].copy_(heads.narrow(1, H + KV, KV))
            else:
                f.k_cache[li][at], f.v_cache[li][at] = k, heads.narrow(1, H + KV, KV)
            o = _attend(q.reshape(B * KV, H // KV, D), keys[li], values[li], mask, f.scale)
            h = lw.mlp(lw.wo.residual(h, o.view(B, H * D), lw.bo))
        return torch.mm(self.norm(h), self.lm_head, out=out)

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                repeats: torch.Tensor) -> torch.Tensor:
        """``LlamaFamilyForward.prefill`` (right-padded prompts ``ids [P, T]``; prompt ``i``'s
        keys/values into ``repeats[i]`` consecutive rows of ``rows``, which the scheduler always
        hands as one contiguous range); returns the last-token logits ``[P, V]``.

        Runs in chunks of prompts whose gate|up activations stay within ``PREFILL_ELEMENTS``
        (cache-sized: 64 prompts of 32 tokens prefill ~15% faster as four chunks), each chunk
        padded only to its own longest prompt."""
        P, T = ids.shape
        per = max(1, PREFILL_ELEMENTS // (T * self.layers[0].wgu.rows.shape[0]))
        if per >= P:
            return self._prefill(ids, lengths, int(rows[0]), repeats)
        ends = torch.cumsum(repeats, 0).tolist()
        out = []
        for a in range(0, P, per):
            b = min(P, a + per)
            width = int(lengths[a:b].max())
            first = int(rows[0]) + (ends[a - 1] if a else 0)
            out.append(self._prefill(ids[a:b, :width], lengths[a:b], first, repeats[a:b]))
        return torch.cat(out)

    def _prefill(self, ids: torch.Tensor, lengths: torch.Tensor, first: int,
                 repeats: torch.Tensor) -> torch.Tensor:
        """``prefill`` of one chunk, its cache rows starting at ``first``."""
        f = self.fwd
        (P, T), H, KV, D = ids.shape, f.heads, f.kv_heads, f.head_dim
        count = int(repeats.sum())
        flat = ids.flatten()
        h = torch.embedding(self.embed, flat)  # [P * T, hidden]
        at, last, cos, sin = torch.arange(P), lengths - 1, f.cos[:T, None], f.sin[:T, None]
        for li, lw in enumerate(self.layers):
            final = li + 1 == len(self.layers)
            if final and lw.table is None:  # q only at each prompt's last token
                x = lw.norm1(h)
                kv = F.linear(x, lw.wkv, lw.bkv).view(P, T, 2 * KV, D)
                q = F.linear(x.view(P, T, -1)[at, last], lw.wq, lw.bq).view(P, H, D)
                q = self._rotate_one(lw, 0, q, f.cos[last, None], f.sin[last, None])  # [P, H, D]
                k, v = self._rotate_one(lw, 1, kv.narrow(2, 0, KV), cos, sin), kv.narrow(2, KV, KV)
            else:
                heads = lw.qkv(h, flat).view(P, T, H + 2 * KV, D)
                (q, k), v = self._rotate(lw, heads, cos, sin), heads.narrow(2, H + KV, KV)
                q = q[at, last] if final else q  # [P, H, D] on the last layer
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [P, KV, T, D]
            store = (k, v) if count == P else (k.repeat_interleave(repeats, 0),
                                               v.repeat_interleave(repeats, 0))
            f.k_cache[li, first:first + count, :, :T], f.v_cache[li, first:first + count, :, :T] = store
            if not final:  # right padding: causal attention keeps real tokens off pads
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=f.scale,
                                                   enable_gqa=KV != H)
                h = lw.mlp(lw.wo.residual(h, o.transpose(1, 2).reshape(P * T, H * D), lw.bo))
                continue
            mask = None if int(lengths.min()) == T else (torch.arange(T) < lengths[:, None])[:, None, None]
            o = F.scaled_dot_product_attention(q.reshape(P, KV, H // KV, D), k, v, attn_mask=mask,
                                               scale=f.scale)
            h = lw.mlp(lw.wo.residual(h.view(P, T, -1)[at, last], o.reshape(P, H * D), lw.bo))
        return torch.mm(self.norm(h), self.lm_head)


class CpuFastGenerator(FastGenerator):
    """The fast path's scheduler on CPU: :class:`CpuForward`'s steps, and per-step bookkeeping cut
    to what the host already knows. Positions and token columns follow from each row's prompt
    length and joining step (host arrays), so no position/count tensors are updated; a row's
    length is its count, since a row that sampled a stop token retires before the next step (the
    host checks each step's tokens against the stop ids, which costs nothing extra on CPU)."""

    def __init__(self, cfg: Any, model: torch.nn.Module):
        super().__init__(cfg, model)
        self.cpu = CpuForward(self.fwd, cpu_gemm.for_model("engine.cpu_gemm", cfg.cpu_gemm, model))
        self.prefill = self._prefill
        self.sync_every = 1 << 62  # the done flags are read when ``_hit`` says a stop was sampled
        self._hit, self._layout, self.workers, self.k = False, None, None, 1  # see ``generate``

    def _refresh(self) -> None:
        """The CPU steps' own weight copies (not fast.py's), and the runner's row buffers (no
        graphs here, so no weight signature to check)."""
        self.cpu.prepare()
        f, run = self.fwd, self.runner
        vocab = f.model.lm_head.out_features
        if run.tok is None or run.tok.shape[0] != f.slots or run.logits.shape[1] != vocab:
            run.tok = torch.zeros(f.slots, dtype=torch.long)
            run.pos = torch.zeros(f.slots, dtype=torch.long)
            run.logits = torch.empty((f.slots, vocab), dtype=f.dtype)
        self._hit, self._layout = False, None

    def generate(self, *args: Any, **kwargs: Any) -> list:
        """``FastGenerator.generate``; with ``k`` > 1 workers (``engine.cpu_workers``, else torch's
        intra-op thread count) it runs on a driver thread of one intra-op thread, which computes
        the first slice of every step while ``k - 1`` workers compute the others: the caller's
        OpenMP team is never woken (its threads spin for milliseconds after every parallel op,
        taking the cores the workers need)."""
        self.k = self.cfg.cpu_workers or torch.get_num_threads()
        if self.k <= 1:
            self.workers = None
            return super().generate(*args, **kwargs)
        self.workers = cpu_workers.pool(self.k - 1)

        def drive() -> list:
            with torch.inference_mode():
                return FastGenerator.generate(self, *args, **kwargs)

        return cpu_workers.pool(1, "driver").submit(drive).result()

    def _admit(self, queue, prompts, live: int, t: int) -> int:
        joined = super()._admit(queue, prompts, live, t)
        if joined != live:
            self._layout = None
        return joined

    def _retire(self, rows: list[int], live: int, t: int) -> int:
        self._layout = None
        return super()._retire(rows, live, t)

    def _retire_finished(self, live: int, t: int, check_done: bool) -> int:
        check, self._hit = check_done or self._hit, False
        return super()._retire_finished(live, t, check)

    def _finished(self, rows: list[int], t: int) -> tuple[list, list, list, list]:
        r = self.rows
        idx = torch.tensor(rows)
        length = (t + 1 - r.start[rows]).tolist()  # sampled so far: one at prefill, one per step since
        return r.tokens[idx].tolist(), r.logps[idx].tolist(), length, r.done[idx].tolist()

    def _rows_layout(self, live: int) -> tuple:
        """(positions at step 0, their min and max, joining steps, whether all rows joined at
        once) of the live rows: host arrays, recomputed only when rows join or leave."""
        if self._layout is None:
            r = self.rows
            offset = r.plen[:live] - r.start[:live]  # a row's position at step t is offset + t
            start = r.start[:live].copy()
            self._layout = (offset, int(offset.min()), int(offset.max()), start, start.min() == start.max())
        return self._layout

    def _on_workers(self, fn, parts: list[tuple[int, int]]) -> list:
        """``fn(a, b)`` for each part: the first here (the driver), the others on the workers, in
        inference mode (thread-local)."""
        def run(a: int, b: int):
            with torch.inference_mode():
                return fn(a, b)

        jobs = [self.workers.submit(run, a, b) for a, b in parts[1:]]
        return [fn(*parts[0]), *(job.result() for job in jobs)]

    def _prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                 repeats: torch.Tensor) -> torch.Tensor:
        """``CpuForward.prefill``, the prompts split among the workers (each share's rows are one
        contiguous range, as the scheduler hands them)."""
        P = ids.shape[0]
        if self.workers is None or P < self.k:
            return self.cpu.prefill(ids, lengths, rows, repeats)
        ends = [0, *torch.cumsum(repeats, 0).tolist()]

        def part(a: int, b: int) -> torch.Tensor:
            width = int(lengths[a:b].max())
            return self.cpu.prefill(ids[a:b, :width], lengths[a:b], rows[ends[a]:ends[b]], repeats[a:b])

        return torch.cat(self._on_workers(part, cpu_workers.slices(P, self.k)))

    def _step(self, live: int, pos: torch.Tensor | None, length: int, same: int | None,
              logits: torch.Tensor) -> None:
        """The decode step's logits into ``logits``, with workers a slice of the rows per thread
        (sampling stays on this thread, so the random stream is the same whatever the split)."""
        tok = self.runner.tok
        if self.workers is None or live < self.cpu.min_slice_rows * self.k:
            self.cpu.decode(tok[:live], pos, length, same, logits)
            return
        self._on_workers(lambda a, b: self.cpu.decode(tok[a:b], None if pos is None else pos[a:b], length,
                                                      same, logits[a:b], a), cpu_workers.slices(live, self.k))

    def _decode(self, live: int, t: int) -> None:
        r = self.rows
        offset, lo, hi, start, one_start = self._rows_layout(live)
        same = lo + t if lo == hi else None
        pos = None if lo == hi else torch.from_numpy(offset + t)
        logits = self.runner.logits[:live]
        self._step(live, pos, hi + t + 1, same, logits)
        tok, lp = sample(logits, self.params, self.gen)
        if one_start:  # one column for all rows: plain slice writes
            col = t + 1 - int(start[0])
            r.tokens[:live, col], r.logps[:live, col] = tok, lp
        else:
            at, col = torch.arange(live), torch.from_numpy(t + 1 - start)
            r.tokens[at, col], r.logps[at, col] = tok, lp
        self.runner.tok[:live] = tok
        if self.stop.numel():
            hit = tok == self.stop if self.stop.numel() == 1 else torch.isin(tok, self.stop)
            if bool(hit.any()):
                r.done[:live] |= hit
                self._hit = True
