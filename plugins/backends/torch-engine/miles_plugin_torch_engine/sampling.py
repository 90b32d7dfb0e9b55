"""Token sampling on the engine's device for the fast path: no host round trip per step.

Same distribution and log-probs as the generic path's ``engine._sample`` (temperature, then top-k
and top-p on the renormalised distribution; the returned log-prob is the sampled token's under
``log_softmax(logits / T)`` before filtering, which is what the trainer recomputes). Without
filters it never materialises the normalised distribution: the exponential race picks
``argmax(x - log E)``, ``E = -log U ~ Exp(1)``, which samples from ``softmax(x)`` for any shift of
``x``, and the log-prob is ``x[tok] - logsumexp(x)``; fewer full-vocabulary passes per step.
"""
from __future__ import annotations

import torch
from miles import SamplingParams

from .engine import _filter


def sample(logits: torch.Tensor, params: SamplingParams,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` and its log-prob (float32)."""
    x = logits.float()
    if params.temperature <= 0:
        tok = x.argmax(dim=-1)
        return tok, x.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1)
    if params.temperature != 1.0:
        x = x / params.temperature
    lse = torch.logsumexp(x, dim=-1)
    race = x
    if 0 < params.top_k < x.shape[-1] or params.top_p < 1.0:
        race = _filter(x - lse[:, None], params.top_k, params.top_p)
    # U = 0 gives E = inf and log E = inf: that token loses, never a NaN (exponential_ may return 0)
    noise = torch.rand(race.shape, generator=gen, device=race.device).log_().neg_().log_()
    tok = (race - noise).argmax(dim=-1)
    return tok, x.gather(-1, tok[:, None]).squeeze(-1) - lse
