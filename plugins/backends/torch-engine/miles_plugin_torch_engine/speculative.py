"""Speculative decoding on the fast path (``engine.speculative``).

A step drafts ``k`` tokens per row (``drafts.py``: the draft head on the target's hidden states,
or a small draft model), then the target runs the row's last token and the ``k`` drafts as one
block of ``k + 1`` positions over its KV cache. Rejection sampling (Leviathan et al. 2023, Chen
et al. 2023) accepts draft ``i`` with probability ``min(1, p_i(d) / q_i(d))``; at the first
rejection the row takes a token from ``max(0, p_i - q_i)`` renormalised, and when all ``k`` pass, a
bonus token from ``p_{k+1}``. ``p`` and ``q`` are the sampling distributions after temperature,
top-k and top-p, so every sequence has exactly the target's distribution; at temperature 0 both
are one-hot and the tokens are the target's greedy ones. The log-probs returned are the target's
(``log_softmax(logits / T)`` at the emitted token, as plain sampling returns them).

Rejected positions need no rollback: their keys and values sit past the row's position, where
decode masks them until they are overwritten. Rows keep their own positions (continuous
batching), so a step's block attends with a per-row mask. The block forward is plain torch on
the fast path's weights and cache (no CUDA graphs, no Triton kernels); a generate call of more
rows than ``max_batch`` goes to the engine's plain fast path instead, where the block's extra
positions cost more than the steps they save.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from miles_fastpath.ops import rms_norm as _rms

from . import cpu_workers
from .batching import FastGenerator
from .cuda_graphs import DecodeRunner
from .engine import _filter
from .fast import LlamaFamilyForward, _lin

# rows above which a step stops paying: on CPU measured by benchmarks/speculative.py --decode
# (1.3x at 8 rows, 0.6x at 64); on CUDA SGLang-like small-batch territory until measured there
AUTO_MAX_BATCH = {"cpu": 16, "cuda": 32}


def forward_block(fwd: LlamaFamilyForward, tok: torch.Tensor, pos: torch.Tensor | None,
                  rows: torch.Tensor | None = None, repeats: torch.Tensor | None = None) -> torch.Tensor:
    """Final (normed) hidden states ``[B, T, d]`` of ``tok [B, T]``.

    Continuation (``pos [B]``): row ``b`` of the packed live rows ``[0, B)`` feeds its tokens at
    positions ``pos[b] ..``, writing their keys/values into its cache row and attending to its
    cache up to each token's own position. Prompts (``pos`` None): right-padded from position 0,
    attention within the block, keys/values into ``repeats[i]`` rows of ``rows`` for prompt ``i``.
    """
    B, T = tok.shape
    h = fwd.inner.embed_tokens(tok)
    if pos is None:
        cos, sin = fwd.cos[:T], fwd.sin[:T]
    else:
        at = pos[:, None] + torch.arange(T, device=tok.device)  # [B, T]
        cos, sin = fwd.cos[at][:, None], fwd.sin[at][:, None]
        length = int(at.max()) + 1
        mask = (torch.arange(length, device=tok.device) <= at[..., None])[:, None]  # [B, 1, T, length]
        slots = torch.arange(B, device=tok.device)[:, None]
    for li, layer in enumerate(fwd.inner.layers):
        q, k, v = fwd._qkv(li, _rms(h, layer.input_layernorm), cos, sin, heads_dim=1)
        if pos is None:
            o = fwd._prefill_attention(li, q, k, v, rows, repeats)
        else:
            fwd.k_cache[li][slots, :, at] = k.transpose(1, 2)
            fwd.v_cache[li][slots, :, at] = v.transpose(1, 2)
            o = F.scaled_dot_product_attention(q, fwd.k_cache[li, :B, :, :length], fwd.v_cache[li, :B, :, :length],
                                               attn_mask=mask, scale=fwd.scale,
                                               enable_gqa=fwd.kv_heads != fwd.heads)
        h = h + _lin(o.transpose(1, 2).reshape(B, T, -1), layer.self_attn.o_proj)
        h = fwd._mlp(li, h)
    return _rms(h, fwd.inner.norm)


def lm_logits(fwd: LlamaFamilyForward, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, fwd.model.lm_head.weight)


def sampling_probs(logits: torch.Tensor, params: Any) -> torch.Tensor:
    """The distribution plain sampling draws from: one-hot argmax at temperature 0, else
    ``softmax(logits / T)`` with top-k / top-p applied (``engine._filter``'s rule)."""
    logits = logits.float()
    if params.temperature <= 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    if 0 < params.top_k < logits.shape[-1] or params.top_p < 1.0:
        flat = _filter(logp.reshape(-1, logp.shape[-1]), params.top_k, params.top_p)
        logp = torch.log_softmax(flat, dim=-1).view_as(logp)
    return logp.exp()


def propose_token(logits: torch.Tensor, params: Any, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft token per row and the distribution it was drawn from (None at temperature 0: the
    argmax, which ``verify`` checks against the target's argmax without distributions)."""
    if params.temperature <= 0:
        return logits.argmax(-1), None
    q = sampling_probs(logits, params)
    return draw(q, gen), q


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs [..., V]`` (inverse CDF; a zero-probability token never wins)."""
    cdf = probs.cumsum(-1)
    u = torch.rand((*probs.shape[:-1], 1), generator=gen, device=probs.device) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def verify(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of ``drafts [B, k]`` (drawn from ``q [B, k, V]``) against the target's
    ``p [B, k + 1, V]``: the ``k + 1`` candidate tokens (accepted drafts, then the corrected or bonus
    token at index ``a``) and ``a [B]``, the number of drafts accepted. ``q`` None: greedy (``p``
    then holds the target's logits), drafts pass while they are the target's argmax."""
    B, k = drafts.shape
    if q is None:
        best = p.argmax(-1)
        accepted = (drafts == best[:, :k]).long().cumprod(dim=1).sum(dim=1)
        out = torch.cat([drafts, best[:, -1:]], dim=1)
        rows = torch.arange(B, device=p.device)
        out[rows, accepted] = best[rows, accepted]
        return out, accepted
    pd = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    qd = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand((B, k), generator=gen, device=p.device)
    accepted = (u * qd < pd).long().cumprod(dim=1).sum(dim=1)  # leading drafts passing min(1, p/q)
    rows = torch.arange(B, device=p.device)
    pa = p[rows, accepted]
    qa = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, accepted]  # no draft after the last
    residual = (pa - qa).clamp_(min=0)
    total = residual.sum(-1, keepdim=True)
    # p <= q everywhere means p == q: no rejection can land here, so any distribution is exact
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), pa)
    out = torch.cat([drafts, drafts[:, :1]], dim=1)
    out[rows, accepted] = draw(residual, gen)
    return out, accepted


class SpecGenerator(FastGenerator):
    """``FastGenerator``'s scheduler (continuous batching, drops, aborts) with speculative steps:
    a row advances by 1 to ``k + 1`` tokens per step. Shares the plain fast path's forward (its
    weights and KV cache) with it."""

    def __init__(self, cfg: Any, model: torch.nn.Module, fwd: LlamaFamilyForward, drafter: Any):
        super().__init__(cfg, model)
        self.fwd = fwd
        self.runner = DecodeRunner(fwd, False)
        self.prefill = self._prefill
        self.sync_every = 1
        self.k, self.drafter = cfg.speculative.tokens, drafter
        limit = cfg.speculative.max_batch
        self.max_batch = AUTO_MAX_BATCH.get(fwd.device.type, 32) if limit == "auto" else limit
        self.totals = {"steps": 0, "emitted": 0, "accepted": 0}  # row-steps; drained by the engine

    def generate(self, *args: Any, **kwargs: Any) -> list:
        """``FastGenerator.generate``; on CPU on a driver thread of one intra-op thread (as the
        plain CPU path's driver, ``cpu_workers``): the caller's OpenMP team stalls at every small
        op whenever another process takes a core."""
        if self.fwd.device.type != "cpu" or torch.get_num_threads() <= 1:
            return super().generate(*args, **kwargs)

        def drive() -> list:
            with torch.inference_mode():
                return FastGenerator.generate(self, *args, **kwargs)

        return cpu_workers.pool(1, "driver").submit(drive).result()

    def _size_cache(self, prompts, steps: int, n: int) -> None:
        super()._size_cache(prompts, steps + self.k + 1, n)  # a block writes k past the last token
        self.drafter.allocate(self.fwd)

    def _refresh(self) -> None:
        self.fwd.refresh()
        self.runner.prepare()

    def _need(self, live: int, t: int) -> int:
        return min(self.fwd.max_len, int(self.runner.pos[:live].max()) + self.k + 1)

    def _prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                 repeats: torch.Tensor) -> torch.Tensor:
        hidden = forward_block(self.fwd, ids, None, rows, repeats)
        at = torch.arange(ids.shape[0], device=ids.device)
        last = hidden[at, lengths - 1]
        self.drafter.join(rows, last.repeat_interleave(repeats, dim=0),
                          ids[at, lengths - 1].repeat_interleave(repeats), ids, lengths, repeats)
        return lm_logits(self.fwd, last)

    def _retire_finished(self, live: int, t: int, check_done: bool) -> int:
        r = self.rows
        out = torch.nonzero(r.done[:live] | (r.count[:live] >= self.steps)).flatten().tolist()
        return self._retire(out, live, t) if out else live

    def _retire(self, rows: list[int], live: int, t: int) -> int:
        left, gone = live - len(rows), set(rows)
        holes = [x for x in rows if x < left]
        if holes:
            movers = [x for x in range(left, live) if x not in gone]
            dev = self.fwd.device
            self.drafter.move(torch.tensor(holes, device=dev), torch.tensor(movers, device=dev),
                              self._need(live, t))
        return super()._retire(rows, live, t)

    def _decode(self, live: int, t: int) -> None:
        r, run, k, params = self.rows, self.runner, self.k, self.params
        last, pos = run.tok[:live].clone(), run.pos[:live].clone()
        drafts, q = self.drafter.propose(live, last, pos, k, params, self.gen)
        hidden = forward_block(self.fwd, torch.cat([last[:, None], drafts], dim=1), pos)
        logits = lm_logits(self.fwd, hidden).float()
        tokens, accepted = verify(logits if q is None else sampling_probs(logits, params), q, drafts, self.gen)
        temp = params.temperature if params.temperature > 0 else 1.0
        logps = torch.log_softmax(logits / temp, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        # emitted: up to the first rejection, the first stop token and the row's token budget
        j = torch.arange(k + 1, device=tokens.device)
        keep = j <= accepted[:, None]
        hit = keep & torch.isin(tokens, self.stop)
        first_stop = torch.where(hit.any(1), hit.float().argmax(1), k + 1)
        keep &= (j <= first_stop[:, None]) & (j < (self.steps - r.count[:live])[:, None])
        n = keep.sum(1)
        at = torch.arange(live, device=tokens.device)
        cols = r.count[:live, None] + j
        rr = at[:, None].expand_as(cols)
        r.tokens[rr[keep], cols[keep]], r.logps[rr[keep], cols[keep]] = tokens[keep], logps[keep]
        r.length[:live] += n
        r.count[:live] += n
        r.done[:live] |= first_stop < n
        run.tok[:live] = tokens[at, n - 1]
        run.pos[:live] = pos + n
        self.drafter.commit(live, hidden[at, n - 1], torch.where(n > 1, tokens[at, (n - 2).clamp(min=0)], last))
        self.totals["steps"] += live
        self.totals["emitted"] += int(n.sum())
        self.totals["accepted"] += int(accepted.sum())

    def drain(self) -> dict[str, float]:
        """``spec_accept_len`` (tokens a row gains per verify step, bonus included) and
        ``spec_accept_rate`` (drafts accepted / drafted) since the last call; empty if none ran."""
        s, self.totals = self.totals, {"steps": 0, "emitted": 0, "accepted": 0}
        if not s["steps"]:
            return {}
        return {"spec_accept_len": s["emitted"] / s["steps"],
                "spec_accept_rate": s["accepted"] / (s["steps"] * self.k)}


def setup(cfg: Any, model: torch.nn.Module, fast: Any) -> SpecGenerator:
    """The speculative generator of ``engine.speculative`` over the plain fast path ``fast``,
    its draft made (a head is attached to ``model`` before the engine lists its weights)."""
    from miles import ConfigError

    from .drafts import make_drafter

    if fast is None:
        raise ConfigError(["engine.speculative runs on the fast path (Llama, Qwen2, Qwen3, Mistral in float32 on "
                           "CPU or on CUDA, engine.impl auto or fast, weights_dtype model); this engine runs the "
                           "model's own forward: remove engine.speculative"])
    drafter = make_drafter(cfg.speculative, model, cfg)
    return SpecGenerator(cfg, model, fast.fwd, drafter)

