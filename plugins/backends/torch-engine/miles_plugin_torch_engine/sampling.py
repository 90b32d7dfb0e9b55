"""Token sampling on the engine's device for the fast path: no host round trip per step.

Same distribution and log-probs as the generic path's ``engine._sample`` (temperature, then top-k
and top-p on the renormalised distribution; the returned log-prob is the sampled token's under
``log_softmax(logits / T)`` before filtering, which is what the trainer recomputes). The draw is
an exponential race, ``argmax(logp - log E)`` with ``E ~ Exp(1)`` per token, which samples from
``softmax(logp)`` with a handful of full-vocabulary passes and no host sync. At temperature 1 the
bf16 logits go straight into a float32 ``log_softmax`` (one pass, no float copy).

On CPU without top-k/top-p the draw is an inverse CDF instead: one uniform per row against the
cumulative probabilities. The race needs a uniform and two logarithms per vocabulary entry, and
CPU ``log`` is slow (~8 ns an element here): 60 -> 40 us for 64 rows of 46 tokens.

On CUDA without top-k/top-p, two Triton kernels (``triton_ops.sample``) read the logits once for
the log-sum-exp and draw by inverse CDF too: at 256 rows of a 152k vocabulary the unfused
log-softmax, noise, subtraction and argmax took ~0.9 ms a decode step, and a fused race (a
Philox uniform and two logarithms per token) still 0.25 ms.
"""
from __future__ import annotations

import torch
from miles import SamplingParams

from . import triton_ops
from .engine import _filter


def _log_noise(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``log E``, ``E ~ Exp(1)``, never ``log 0``: CUDA's ``exponential_`` excludes 0 by
    construction; on CPU ``E = -log U`` with ``U`` in [0, 1), where ``U = 0`` only makes ``E``
    infinite (that token loses)."""
    if like.device.type == "cuda":
        return torch.empty_like(like).exponential_(generator=gen).log_()
    return torch.rand(like.shape, generator=gen, device=like.device).log_().neg_().log_()


def sample(logits: torch.Tensor, params: SamplingParams,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` and its log-prob (float32)."""
    plain = not (0 < params.top_k < logits.shape[-1] or params.top_p < 1.0)
    if logits.is_cuda and plain and triton_ops.available():  # one read of the logits, two kernels
        seed = None if params.temperature <= 0 else torch.randint(
            2**31 - 1, (1,), generator=gen, device=logits.device)
        return triton_ops.sample(logits, params.temperature, seed)
    if params.temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    if params.temperature == 1.0:
        logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    else:
        logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    race = logp
    if not plain:
        race = _filter(logp, params.top_k, params.top_p)
    elif logp.is_cpu:
        return _inverse_cdf(logp, gen)
    tok = (race - _log_noise(race, gen)).argmax(dim=-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _inverse_cdf(logp: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``i`` with probability ``exp(logp[i])``: the first index whose cumulative probability
    exceeds ``U * total``, ``U ~ U[0, 1)`` (clamped, should rounding put it at the total). A token
    of probability 0 adds no step to the CDF, so it is never the first to exceed it."""
    cdf = logp.exp().cumsum_(-1)
    u = torch.rand((logp.shape[0], 1), generator=gen, device=logp.device).mul_(cdf[:, -1:])
    tok = torch.searchsorted(cdf, u, right=True).clamp_(max=logp.shape[-1] - 1)
    return tok.view(-1), logp.gather(-1, tok).view(-1)
