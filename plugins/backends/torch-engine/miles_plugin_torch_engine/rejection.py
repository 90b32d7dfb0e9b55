"""Rejection sampling of drafted tokens, shared by the fast path's speculative steps
(``speculative.py``) and the model's own forward with MTP drafts (``hf_speculative.py``).

Draft ``i`` is accepted with probability ``min(1, p_i(d) / q_i(d))``; at the first rejection the
row takes a token from ``max(0, p_i - q_i)`` renormalised, and when all ``k`` pass, a bonus token
from ``p_{k+1}`` (Leviathan et al. 2023, Chen et al. 2023). ``p`` and ``q`` are the distributions
plain sampling draws from (temperature, top-k, top-p), so every sequence keeps exactly the target's
distribution; at temperature 0 the drafts pass while they are the target's argmax.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .engine import _filter


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


def propose_token(logits: torch.Tensor, params: Any, gen: torch.Generator,
                  u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft token per row and the distribution it was drawn from (None at temperature 0: the
    argmax, which ``verify`` checks against the target's argmax without distributions). ``u``:
    the draw's uniforms ``[B, 1]``, drawn beforehand (a CUDA graph), else from ``gen``."""
    if params.temperature <= 0:
        return logits.argmax(-1), None
    q = sampling_probs(logits, params)
    return draw(q, gen, u), q


def draw(probs: torch.Tensor, gen: torch.Generator, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``probs [..., V]`` (inverse CDF; a zero-probability token never wins);
    ``u [..., 1]``: uniforms on [0, 1) drawn beforehand, else drawn here from ``gen``."""
    cdf = probs.cumsum(-1)
    if u is None:
        u = torch.rand((*probs.shape[:-1], 1), generator=gen, device=probs.device)
    u = u * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def verify(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor,
           gen: torch.Generator, u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of ``drafts [B, k]`` (drawn from ``q [B, k, V]``) against the target's
    ``p [B, k + 1, V]``: the ``k + 1`` candidate tokens (accepted drafts, then the corrected or bonus
    token at index ``a``) and ``a [B]``, the number of drafts accepted. ``q`` None: greedy (``p``
    then holds the target's logits), drafts pass while they are the target's argmax. ``u [B, k + 1]``:
    the uniforms (``k`` acceptance tests, then the residual's draw) drawn beforehand, else from
    ``gen``."""
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
    ua = torch.rand((B, k), generator=gen, device=p.device) if u is None else u[:, :k]
    accepted = (ua * qd < pd).long().cumprod(dim=1).sum(dim=1)  # leading drafts passing min(1, p/q)
    rows = torch.arange(B, device=p.device)
    pa = p[rows, accepted]
    qa = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, accepted]  # no draft after the last
    residual = (pa - qa).clamp_(min=0)
    total = residual.sum(-1, keepdim=True)
    # p <= q everywhere means p == q: no rejection can land here, so any distribution is exact
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), pa)
    out = torch.cat([drafts, drafts[:, :1]], dim=1)
    out[rows, accepted] = draw(residual, gen, None if u is None else u[:, k:])
    return out, accepted


def acceptance(totals: dict[str, Any], k: int) -> dict[str, float]:
    """``spec_accept_len`` (tokens a row gains per verify step, bonus included) and
    ``spec_accept_rate`` (drafts accepted / drafted) of ``totals``: row-steps, tokens emitted and
    drafts accepted (ints or device tensors); empty if no step ran."""
    if not totals["steps"]:
        return {}
    s = {key: int(v) for key, v in totals.items()}
    return {"spec_accept_len": s["emitted"] / s["steps"], "spec_accept_rate": s["accepted"] / (s["steps"] * k)}
