"""Policy ratios and the per-token terms built on them: PPO-clip, GSPO's sequence ratio, the
rollout/trainer mismatch corrections (TIS, mask) and the sampled-token entropy estimate.

Every ``exp`` of a log-ratio here goes through :func:`clamped_log_ratio` (``[-20, 20]``, where
verl clamps its ratio's log): beyond that float32 overflows long before the value carries
information, and one such token would make a whole step's loss ``inf``.
"""
from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0
# GSPO's sequence log-ratio is capped above at 10 (as verl caps it): a whole sequence's ratio
# beyond e^10 only happens for a broken policy, and with a negative advantage it is the loss.
SEQ_LOG_RATIO_MAX = 10.0


def clamped_log_ratio(logprobs: torch.Tensor, base_logprobs: torch.Tensor) -> torch.Tensor:
    """``logprobs - base_logprobs`` clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` (no
    gradient flows through a clamped entry)."""
    return (logprobs - base_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  clip_low: float, clip_high: float | None = None,
                  dual_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``max(-A*ratio, -A*clip(ratio, 1-clip_low, 1+clip_high))``,
    capped at ``-c*A`` where ``A < 0`` when ``dual_clip_c`` is set.

    Returns ``(loss, clipped)``: both shaped like ``logprobs``; ``clipped`` is a bool tensor, True
    where the clipped term was the larger (the token's gradient is cut off). For a
    sequence-level ratio (GSPO) pass ``sequence_log_ratio(...)`` as ``logprobs`` and zeros as
    ``old_logprobs``.
    """
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(clamped_log_ratio(logprobs, old_logprobs))
    unclipped = -advantages * ratio
    clipped_term = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped_term)
    if dual_clip_c is not None:
        # Only negative advantages: a huge ratio there makes -A*ratio unbounded above.
        capped = torch.minimum(loss, -dual_clip_c * advantages)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, clipped_term > unclipped


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio ``mean_t(logp - old_logp)`` over the loss mask,
    capped above at ``SEQ_LOG_RATIO_MAX``, broadcast to every token ``[B, R]`` (so ``exp`` of it is
    the paper's ``s_i(theta)``).

    It keeps the gradient of every token of the sequence: ``d s_i = s_i * mean_t d logp_t``.
    """
    per_seq = ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    per_seq = per_seq.clamp(max=SEQ_LOG_RATIO_MAX)
    return per_seq.unsqueeze(-1).expand_as(logprobs)


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling for the rollout/trainer mismatch (Miles' vanilla TIS):
    ``w = min(exp(old_logp - rollout_logp), cap)``, no gradient."""
    return torch.exp(clamped_log_ratio(old_logprobs, rollout_logprobs).detach()).clamp(max=cap)


def mismatch_keep(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, low: float,
                  high: float) -> torch.Tensor:
    """1.0 where ``exp(old_logp - rollout_logp)`` lies in ``[low, high]``, else 0.0 (the
    icepop-style mask: tokens the engine and the trainer disagree on too much are dropped)."""
    ratio = torch.exp(clamped_log_ratio(old_logprobs, rollout_logprobs).detach())
    return ((ratio >= low) & (ratio <= high)).to(old_logprobs.dtype)


def sampled_entropy(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token entropy estimate from the sampled tokens alone (no logits needed).

    Value: ``rho * (-logp)`` with ``rho = exp(logp - old_logp)`` (detached), an unbiased
    estimate of the policy's entropy at that position since the token was drawn from the old
    policy. Gradient: ``-rho * logp * d logp``, whose expectation is the entropy's gradient
    (``dH = -E[logp * d logp]`` because ``E[d logp] = 0``). Differentiating ``-logp`` itself
    would be useless: its expected gradient is 0.
    """
    rho = torch.exp(clamped_log_ratio(logprobs, old_logprobs).detach())
    lp = logprobs.detach()
    return rho * (-lp - lp * (logprobs - lp))
