"""The fast path's decode step on CPU, in as few torch calls as the math allows.

A decode step of a small model on CPU is dominated by the GEMMs and by attention over the cache;
every other op costs a few microseconds of dispatch whatever its size, so this step is written to
issue as few as possible (about 15 a layer): RMSNorm as one ``F.rms_norm`` (bit-identical to HF's
float32 composite, checked at construction, else the composite), q|k|v and gate|up as one GEMM
each on the fused weights, the residual adds folded into the o/down GEMMs (``addmm``), RoPE as
``x * cos + roll(x) * sin`` on q and k together, and keys/values written with one slice copy each
when every row sits at the same position (then attention needs no mask either). Rows at different
positions take an indexed write and an additive mask made once per step.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .batching import FastGenerator
from .fast import LlamaFamilyForward, _rms
from .sampling import sample


def _rms_is_exact(dtype: torch.dtype) -> bool:
    """Whether ``F.rms_norm`` equals HF's RMSNorm op order bit for bit here (float32 on CPU)."""
    if dtype != torch.float32:
        return False
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 96, generator=g) * 3, torch.randn(96, generator=g)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    return torch.equal(F.rms_norm(x, (96,), w, 1e-6), ref)


class CpuDecoder:
    """``decode`` of a :class:`LlamaFamilyForward` for CPU; ``prepare`` after every ``refresh``."""

    def __init__(self, fwd: LlamaFamilyForward):
        self.fwd = fwd
        self.fused_rms = _rms_is_exact(fwd.dtype)
        self.layers: list[tuple[Any, ...]] = []

    def _norm(self, norm: Any):
        if self.fused_rms:
            w, eps, shape = norm.weight, norm.variance_epsilon, (norm.weight.shape[0],)
            return lambda x: F.rms_norm(x, shape, w, eps)
        return lambda x: _rms(x, norm)

    def prepare(self) -> None:
        """Per-layer weights as the step uses them (transposed views, norms): read again at every
        ``generate`` since the weights may have been replaced."""
        f = self.fwd
        self.layers = []
        for li, layer in enumerate(f.inner.layers):
            fused, attn, mlp = f._fused[li], layer.self_attn, layer.mlp
            self.layers.append((
                self._norm(layer.input_layernorm), fused["qkv"].t(), fused["qkv_bias"],
                attn.o_proj.weight.t(), attn.o_proj.bias, self._norm(layer.post_attention_layernorm),
                fused["gate_up"].t(), fused["gate_up_bias"], mlp.down_proj.weight.t(), mlp.down_proj.bias,
                (self._norm(attn.q_norm), self._norm(attn.k_norm)) if f.qk_norm else None))
        self.final_norm = self._norm(f.inner.norm)
        self.lm_head = f.model.lm_head.weight.t()
        self.embed = f.inner.embed_tokens.weight

    def decode(self, tok: torch.Tensor, pos: torch.Tensor, length: int, same_pos: int | None,
               out: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` (into ``out``) of one token per cache row ``0..B-1`` at ``pos``;
        ``same_pos``: the position every row is at (host int), or None."""
        f = self.fwd
        B, H, KV, D = tok.shape[0], f.heads, f.kv_heads, f.head_dim
        h = F.embedding(tok, self.embed)
        if same_pos is not None:
            cos, sin, mask = f.cos[same_pos], f.sin[same_pos], None
            write = (slice(0, B), slice(None), same_pos)
        else:
            cos, sin = f.cos[pos].unsqueeze(1), f.sin[pos].unsqueeze(1)
            mask = torch.zeros((B, 1, 1, length), dtype=h.dtype).masked_fill_(
                torch.arange(length) > pos.view(B, 1, 1, 1), float("-inf"))
            write = (torch.arange(B), slice(None), pos)
        for li, (n1, wqkv, bqkv, wo, bo, n2, wgu, bgu, wd, bd, qk_norms) in enumerate(self.layers):
            x = n1(h)
            qkv = (torch.mm(x, wqkv) if bqkv is None else torch.addmm(bqkv, x, wqkv)).view(B, H + 2 * KV, D)
            if qk_norms is None:
                qk = qkv[:, :H + KV]
                qk = qk * cos + torch.roll(qk, D // 2, -1) * sin  # see fast._rope
                q, k = qk[:, :H], qk[:, H:]
            else:
                q, k = qk_norms[0](qkv[:, :H]), qk_norms[1](qkv[:, H:H + KV])
                q = q * cos + torch.roll(q, D // 2, -1) * sin
                k = k * cos + torch.roll(k, D // 2, -1) * sin
            kc, vc = f.k_cache[li], f.v_cache[li]
            kc[write] = k
            vc[write] = qkv[:, H + KV:]
            o = F.scaled_dot_product_attention(q.view(B, KV, H // KV, D), kc[:B, :, :length],
                                               vc[:B, :, :length], attn_mask=mask, scale=f.scale)
            o = o.reshape(B, H * D)
            h = torch.addmm(h, o, wo) if bo is None else h + F.linear(o, wo.t(), bo)
            gu = torch.mm(n2(h), wgu) if bgu is None else torch.addmm(bgu, n2(h), wgu)
            inter = gu.shape[1] // 2
            act = F.silu(gu[:, :inter]).mul_(gu[:, inter:])
            h = torch.addmm(h, act, wd) if bd is None else h + F.linear(act, wd.t(), bd)
        return torch.mm(self.final_norm(h), self.lm_head, out=out)


class CpuFastGenerator(FastGenerator):
    """The fast path's scheduler on CPU: the decode step of :class:`CpuDecoder`, and per-step
    bookkeeping cut to what the host already knows. Positions and token columns follow from each
    row's prompt length and joining step (host arrays), so no position/count tensors are updated;
    a row's length is its count (a row that sampled a stop token retires before the next step,
    which a host check of that step's tokens costs nothing extra to ensure on CPU)."""

    def __init__(self, cfg: Any, model: torch.nn.Module):
        super().__init__(cfg, model)
        self.decoder = CpuDecoder(self.fwd)
        self.sync_every = 1 << 62  # stop checks are driven by ``_hit`` (set when a stop is sampled)
        self._hit = False

    def _size_cache(self, prompts, steps: int, n: int) -> None:
        super()._size_cache(prompts, steps, n)
        self.decoder.prepare()
        self._hit = False

    def _retire_finished(self, live: int, t: int, check_done: bool) -> int:
        check, self._hit = check_done or self._hit, False
        return super()._retire_finished(live, t, check)

    def _finished(self, rows: list[int], t: int) -> tuple[list, list, list, list]:
        r = self.rows
        idx = torch.tensor(rows)
        length = (t + 1 - r.start[rows]).tolist()  # sampled so far: one at prefill, one per step since
        return r.tokens[idx].tolist(), r.logps[idx].tolist(), length, r.done[idx].tolist()

    def _decode(self, live: int, t: int) -> None:
        r = self.rows
        offset = r.plen[:live] - r.start[:live]  # a row's position at step t is offset + t
        lo, hi = int(offset.min()), int(offset.max())
        pos = None if lo == hi else torch.from_numpy(offset + t)
        logits = self.decoder.decode(self.runner.tok[:live], pos, hi + t + 1, lo + t if lo == hi else None,
                                     self.runner.logits[:live])
        tok, lp = sample(logits, self.params, self.gen)
        start = r.start[:live]
        if start.min() == start.max():  # one column for all rows: plain slice writes
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
