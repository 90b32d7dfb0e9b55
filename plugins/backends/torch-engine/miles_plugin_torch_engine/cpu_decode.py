"""The fast path on CPU (float32): prefill and decode steps in as few torch calls as the math
allows, and a scheduler whose per-step bookkeeping stays on the host.

On CPU a decode step of a small model is the GEMMs, attention over the cache, and a few
microseconds of dispatch per op whatever its size; HF's forward spends most of a step on the
latter. So a layer here is about 20 calls:

- The engine's weight copies (made at every ``generate``, since the weights may have been
  replaced) fold each RMSNorm's weight into the GEMM after it (``(w * x) @ W.T == x @ (W * w).T``),
  so a norm is just the row scale ``rsqrt(mean(x^2) + eps)``; q|k|v and gate|up are one GEMM each;
  the residual adds happen inside the o/down GEMMs (``addmm``).
- The q/k rows of each head are reordered to interleave the two halves HF's RoPE pairs up, so RoPE
  is one complex multiply (bit-identical to HF's ``x * cos + rotate_half(x) * sin``) and writes the
  rotated keys straight into the cache. Attention only takes dot products of q with k, which the
  shared reordering leaves unchanged.
- The cache is stored position-major, ``[layers, slots, positions, KV, D]``, so a row's keys up to
  any length are one ``[length * KV, D]`` matrix: attention for all heads of a row is one GEMM
  against it (``baddbmm``), with an additive mask that keeps each query head on its own KV head,
  then softmax and one GEMM with the values: three batched calls over rows with half the
  products wasted, cheaper on CPU than SDPA's per-(row, KV head) work at decode sizes.
- With a small vocabulary (character/byte tokenizers), layer 0's q|k|v of every token id is a
  table made once per ``generate``: that layer's norm and GEMM become a row lookup.
- When every row sits at the same position (prompts of one length) the cache writes are slice
  copies and the mask a constant; otherwise indexed writes and a mask made once per step.
- The last prefill layer runs attention, o_proj and the MLP only on each prompt's last token (the
  other tokens only feed that layer's keys/values).

Results equal HF's forward up to float rounding of a different operation order (the CPU tests
hold greedy tokens to the uncached reference and log-probs to 1e-5 of a full HF forward).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from miles import MilesError

from .batching import FastGenerator
from .fast import LlamaFamilyForward
from .sampling import sample

TABLE_ELEMENTS = 1 << 22  # layer 0's q|k|v is tabled per token id below this many table entries


def _linear(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)


def _residual(h: torch.Tensor, x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``h + x @ wt (+ bias)``, the add inside the GEMM when there is no bias."""
    return torch.addmm(h, x, wt) if bias is None else h + torch.addmm(bias, x, wt)


def _complex(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` (interleaved halves) as ``[..., D / 2]`` complex, no copy."""
    return torch.view_as_complex(x.view(*x.shape[:-1], x.shape[-1] // 2, 2))


class _Scale:
    """An RMSNorm without its weight (folded into the next GEMM): ``x * rsqrt(mean(x^2) + eps)``."""

    def __init__(self, norm: Any):
        self.eps = torch.tensor(norm.variance_epsilon, dtype=torch.float32)
        self.inv_n = 1.0 / norm.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x * torch.addcmul(self.eps, n, n, value=self.inv_n).rsqrt_()


class _Layer:
    """One decoder layer's engine-owned weights (transposed for ``mm``, norms folded in)."""

    def __init__(self, layer: Any, rows: torch.Tensor, perm: torch.Tensor, qk_norm: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.scale1, self.scale2 = _Scale(layer.input_layernorm), _Scale(layer.post_attention_layernorm)
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        w = torch.cat([p.weight for p in projs])[rows] * layer.input_layernorm.weight
        self.wqkv = w.t()
        self.bqkv = torch.cat([p.bias for p in projs])[rows] if attn.q_proj.bias is not None else None
        q_cols = attn.q_proj.out_features  # the q and k|v parts, for the last prefill layer
        self.wq, self.wkv = self.wqkv[:, :q_cols], self.wqkv[:, q_cols:]
        self.bq, self.bkv = (None, None) if self.bqkv is None else (self.bqkv[:q_cols], self.bqkv[q_cols:])
        self.wo, self.bo = attn.o_proj.weight.t(), attn.o_proj.bias
        gate, up = mlp.gate_proj, mlp.up_proj
        self.wgu = (torch.cat([gate.weight, up.weight]) * layer.post_attention_layernorm.weight).t()
        self.bgu = torch.cat([gate.bias, up.bias]) if gate.bias is not None else None
        self.wd, self.bd = mlp.down_proj.weight.t(), mlp.down_proj.bias
        self.inter = mlp.down_proj.in_features
        self.qk_norms = None
        if qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE, weights in the reordered layout
            self.qk_norms = tuple((n.weight[perm], n.variance_epsilon) for n in (attn.q_norm, attn.k_norm))
        self.table: torch.Tensor | None = None  # q|k|v per token id (layer 0, small vocabularies)

    def qkv(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return torch.embedding(self.table, ids)
        return _linear(self.scale1(h), self.wqkv, self.bqkv)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gu = _linear(self.scale2(h), self.wgu, self.bgu)
        act = F.silu(gu.narrow(-1, 0, self.inter)).mul_(gu.narrow(-1, self.inter, self.inter))
        return _residual(h, act, self.wd, self.bd)


class CpuForward:
    """Prefill and decode over the (position-major) KV cache of a :class:`LlamaFamilyForward`,
    whose keys are kept in the reordered head layout; ``prepare`` before every ``generate``."""

    def __init__(self, fwd: LlamaFamilyForward):
        self.fwd = fwd
        fwd.positions_major = True
        self.layers: list[_Layer] = []

    @torch.no_grad()
    def prepare(self) -> None:
        f = self.fwd
        H, KV, D = f.heads, f.kv_heads, f.head_dim
        half = D // 2
        perm = torch.arange(D).view(2, half).t().flatten()  # 0, D/2, 1, D/2 + 1, ...
        rows = torch.cat([perm + i * D for i in range(H + KV)]
                         + [torch.arange((H + KV) * D, (H + 2 * KV) * D)])  # v rows as they are
        self.layers = [_Layer(layer, rows, perm, f.qk_norm) for layer in f.inner.layers]
        self.scale = _Scale(f.inner.norm)
        self.lm_head = (f.model.lm_head.weight * f.inner.norm.weight).t()
        self.embed = f.inner.embed_tokens.weight
        if self.embed.shape[0] * rows.shape[0] <= TABLE_ELEMENTS:
            self.layers[0].table = self.layers[0].qkv(self.embed, None)
        # fast.py keeps HF's cos/sin with rotate_half's sign folded into the first half of sin
        cos, sin = f.cos[:, :half], -f.sin[:, :half]
        if not (torch.equal(cos, f.cos[:, half:]) and torch.equal(sin, f.sin[:, half:])):
            raise MilesError("torch engine (CPU fast path): the RoPE table does not repeat its "
                             "frequencies over the two halves of a head; set engine.impl=hf")
        self.rot = torch.complex(cos, sin)
        # additive mask over a row's keys [position, KV head]: query head i only sees KV head i // G
        own = torch.arange(H)[:, None, None] // (H // KV) == torch.arange(KV)
        self.block = torch.zeros(H, f.max_len, KV).masked_fill_(~own, float("-inf")).view(H, -1)
        self.layer_kv = (f.k_cache.transpose(2, 3), f.v_cache.transpose(2, 3))  # storage order

    @staticmethod
    def _q(lw: _Layer, q: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """Rotated complex q of real heads ``[..., H, D]`` (after Qwen3's q norm)."""
        if lw.qk_norms is not None:
            q = torch.rms_norm(q, (q.shape[-1],), *lw.qk_norms[0])
        return _complex(q) * rot

    @staticmethod
    def _k(lw: _Layer, k: torch.Tensor) -> torch.Tensor:
        """Complex k of real heads ``[..., KV, D]`` (after Qwen3's k norm), not yet rotated."""
        if lw.qk_norms is not None:
            k = torch.rms_norm(k, (k.shape[-1],), *lw.qk_norms[1])
        return _complex(k)

    def _mask(self, pos: torch.Tensor, length: int) -> torch.Tensor:
        """``block`` plus, per row, -inf past its position: ``[B, H, length * KV]``."""
        B, H, KV = pos.shape[0], self.fwd.heads, self.fwd.kv_heads
        hidden = torch.zeros(B, 1, length, 1).masked_fill_(torch.arange(length).view(1, 1, -1, 1) >
                                                           pos.view(B, 1, 1, 1), float("-inf"))
        return (hidden + self.block[:, :length * KV].view(H, length, KV)).view(B, H, -1)

    def decode(self, tok: torch.Tensor, pos: torch.Tensor | None, length: int, same_pos: int | None,
               out: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` (into ``out``) of one token per cache row ``0..B-1``, fed at
        ``same_pos`` (a host int: every row there) or else at ``pos [B]``; attends to cache
        positions ``< length`` (and, with ``pos``, ``<= pos``)."""
        f = self.fwd
        B, H, KV, D = tok.shape[0], f.heads, f.kv_heads, f.head_dim
        # [layers, B, positions, KV, D]
        ks, vs = self.layer_kv[0].narrow(1, 0, B), self.layer_kv[1].narrow(1, 0, B)
        keys = ks.narrow(2, 0, length).flatten(2, 3).transpose(2, 3).unbind(0)  # [B, D, length * KV]
        values = vs.narrow(2, 0, length).flatten(2, 3).unbind(0)
        if same_pos is not None:
            rot, mask = self.rot[same_pos], self.block[:, :length * KV]
            k_new, v_new = _complex(ks.select(2, same_pos)).unbind(0), vs.select(2, same_pos).unbind(0)
        else:
            rot, mask, at = self.rot[pos].unsqueeze(1), self._mask(pos, length), (torch.arange(B), pos)
        h = torch.embedding(self.embed, tok)
        for li, lw in enumerate(self.layers):
            heads = lw.qkv(h, tok).view(B, H + 2 * KV, D)
            q, k = self._q(lw, heads.narrow(1, 0, H), rot), self._k(lw, heads.narrow(1, H, KV))
            v = heads.narrow(1, H + KV, KV)
            if same_pos is not None:
                torch.mul(k, rot, out=k_new[li])
                v_new[li].copy_(v)
            else:
                self.layer_kv[0][li][at] = torch.view_as_real(k * rot).flatten(-2)
                self.layer_kv[1][li][at] = v
            s = torch.baddbmm(mask, torch.view_as_real(q).view(B, H, D), keys[li], alpha=f.scale)
            o = torch.bmm(torch.softmax(s, -1), values[li]).view(B, H * D)
            h = lw.mlp(_residual(h, o, lw.wo, lw.bo))
        return torch.mm(self.scale(h), self.lm_head, out=out)

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                repeats: torch.Tensor) -> torch.Tensor:
        """``LlamaFamilyForward.prefill`` (right-padded prompts ``ids [P, T]``; prompt ``i``'s
        keys/values into ``repeats[i]`` consecutive rows of ``rows``, which the scheduler always
        hands as one contiguous range); returns the last-token logits ``[P, V]``."""
        f = self.fwd
        (P, T), H, KV, D = ids.shape, f.heads, f.kv_heads, f.head_dim
        first, count = int(rows[0]), rows.shape[0]
        flat = ids.flatten()
        h = torch.embedding(self.embed, flat)  # [P * T, hidden]
        at, last, rot = torch.arange(P), lengths - 1, self.rot[:T, None]
        for li, lw in enumerate(self.layers):
            final = li + 1 == len(self.layers)
            if final and lw.table is None:  # q only at each prompt's last token
                x = lw.scale1(h)
                kv = _linear(x, lw.wkv, lw.bkv).view(P, T, 2 * KV, D)
                k, v = kv.narrow(2, 0, KV), kv.narrow(2, KV, KV)
                q_last = _linear(x.view(P, T, -1)[at, last], lw.wq, lw.bq).view(P, H, D)
                q_last = self._q(lw, q_last, self.rot[last].unsqueeze(1))
            else:
                heads = lw.qkv(h, flat).view(P, T, H + 2 * KV, D)
                q = self._q(lw, heads.narrow(2, 0, H), rot)
                k, v = heads.narrow(2, H, KV), heads.narrow(2, H + KV, KV)
                q_last = q[at, last] if final else None
            k = torch.view_as_real(self._k(lw, k) * rot).flatten(-2)  # [P, T, KV, D]
            store = (k, v) if count == P else (k.repeat_interleave(repeats, 0),
                                               v.repeat_interleave(repeats, 0))
            for cache, new in zip(self.layer_kv, store):  # into [rows, positions, KV, D]
                cache[li, first:first + count, :T] = new
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if not final:  # right padding: causal attention keeps real tokens off pads
                q = torch.view_as_real(q).flatten(-2).transpose(1, 2)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=f.scale,
                                                   enable_gqa=KV != H)
                h = lw.mlp(_residual(h, o.transpose(1, 2).reshape(P * T, H * D), lw.wo, lw.bo))
                continue
            # last layer: only each prompt's last token goes on (to the logits)
            mask = None if int(lengths.min()) == T else (torch.arange(T) < lengths[:, None])[:, None, None]
            o = F.scaled_dot_product_attention(torch.view_as_real(q_last).reshape(P, KV, H // KV, D), k, v,
                                               attn_mask=mask, scale=f.scale)
            h = lw.mlp(_residual(h.view(P, T, -1)[at, last], o.reshape(P, H * D), lw.wo, lw.bo))
        return torch.mm(self.scale(h), self.lm_head)


class CpuFastGenerator(FastGenerator):
    """The fast path's scheduler on CPU: :class:`CpuForward`'s steps, and per-step bookkeeping cut
    to what the host already knows. Positions and token columns follow from each row's prompt
    length and joining step (host arrays), so no position/count tensors are updated; a row's
    length is its count, since a row that sampled a stop token retires before the next step (the
    host checks each step's tokens against the stop ids, which costs nothing extra on CPU)."""

    def __init__(self, cfg: Any, model: torch.nn.Module):
        super().__init__(cfg, model)
        self.cpu = CpuForward(self.fwd)
        self.prefill = self.cpu.prefill
        self.sync_every = 1 << 62  # the done flags are read when ``_hit`` says a stop was sampled
        self._hit, self._layout = False, None

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

    def _decode(self, live: int, t: int) -> None:
        r = self.rows
        offset, lo, hi, start, one_start = self._rows_layout(live)
        same = lo + t if lo == hi else None
        pos = None if lo == hi else torch.from_numpy(offset + t)
        logits = self.cpu.decode(self.runner.tok[:live], pos, hi + t + 1, same, self.runner.logits[:live])
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
