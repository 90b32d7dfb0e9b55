"""GRPO: group-relative advantages and the PPO-clip policy loss.

The pure functions (``group_advantages``, ``kl_estimate``, ``ppo_clip_loss``, ``aggregate``,
``masked_mean``) are public so sibling algorithms (GSPO, PPO, ...) can reuse them.
"""
from __future__ import annotations

import math

from typing import Sequence

import torch

from miles import Batch, Group

from .config import GRPOConfig

STD_EPS = 1e-6
# exp() of a log-ratio beyond this overflows float32 long before it carries information.
LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards: Sequence[float], std_normalize: bool = True) -> list[float]:
    """Advantages of one group: ``r - mean(r)``, divided by ``std + 1e-6`` (unbiased std) when
    ``std_normalize`` and the std is positive.

    A single-sample group has no baseline to compare against, so its advantage is the raw
    reward (REINFORCE without baseline) rather than a vacuous 0.
    """
    r = [float(x) for x in rewards]  # plain floats: groups are tiny, tensors cost more than math
    if len(r) == 1:
        return r
    mean = sum(r) / len(r)
    adv = [x - mean for x in r]
    if std_normalize:
        std = math.sqrt(sum(a * a for a in adv) / (len(r) - 1))
        if std > 0:
            adv = [a / (std + STD_EPS) for a in adv]
    return adv


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman's k1/k2/k3),
    with ``lr = logprobs - ref_logprobs``."""
    lr = logprobs - ref_logprobs
    if kind == "k1":
        return lr
    if kind == "k2":
        return lr.pow(2) / 2
    if kind == "k3":
        # Clamping only the exp argument keeps k3 finite where the two models disagree wildly.
        return torch.exp((-lr).clamp(max=LOG_RATIO_CLAMP)) - 1 + lr
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  clip_low: float, clip_high: float | None = None,
                  dual_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``max(-A*ratio, -A*clip(ratio, 1-clip_low, 1+clip_high))``,
    capped at ``-c*A`` where ``A < 0`` when ``dual_clip_c`` is set.

    Returns ``(loss, clipped)``: both shaped like ``logprobs``; ``clipped`` is a bool tensor, True
    where the clipped term was the larger (the token's gradient is cut off).
    """
    clip_high = clip_low if clip_high is None else clip_high
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_term = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped_term)
    if dual_clip_c is not None:
        # Only negative advantages: a huge ratio there makes -A*ratio unbounded above.
        capped = torch.minimum(loss, -dual_clip_c * advantages)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, clipped_term > unclipped


def aggregate(batch: Batch, x: torch.Tensor, loss_agg: str = "token-mean",
              max_response_len: int = 1024) -> torch.Tensor:
    """This micro-batch's share of the step-level aggregate of per-token ``x`` ``[B, R]``.

    Every mode divides by step-global constants only, so summing it over micro-batches gives
    exactly the value (and gradient) of the whole batch.
    """
    if loss_agg == "token-mean":
        return batch.token_mean(x)
    if loss_agg == "seq-mean-token-mean":
        return batch.seq_mean(x)
    if loss_agg == "seq-mean-token-sum-norm":
        return (x * batch.loss_mask).sum() / max_response_len / max(batch.global_samples, 1)
    raise ValueError(f"unknown loss_agg {loss_agg!r}; expected 'token-mean', "
                     f"'seq-mean-token-mean' or 'seq-mean-token-sum-norm'")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Plain mean of ``x`` over ``mask`` within one micro-batch, as a python float (for metrics)."""
    x = x.detach().float()
    return float((x * mask).sum() / mask.sum().clamp(min=1))


class GRPO:
    """Group Relative Policy Optimization, implementing ``miles.protocols.Algorithm``."""

    uses_rollout = True

    def __init__(self, cfg: GRPOConfig | None = None):
        self.cfg = cfg if cfg is not None else GRPOConfig()

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    def keep(self, group: Group) -> bool:
        rewards = group.rewards
        if not self.cfg.filter_zero_variance or len(rewards) < 2:
            return True
        return any(r != rewards[0] for r in rewards)

    def advantages(self, groups: Sequence[Group]) -> list[list[float]]:
        return [group_advantages(g.rewards, self.cfg.std_normalize) for g in groups]

    def loss(self, batch: Batch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        cfg, mask = self.cfg, batch.loss_mask
        # Without old log-probs this is the single on-policy update: ratio 1, gradient = PG.
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        per_token, clipped = ppo_clip_loss(logprobs, old, batch.advantages, cfg.clip_low,
                                           cfg.clip_high_value, cfg.dual_clip_c)
        loss = aggregate(batch, per_token, cfg.loss_agg, cfg.max_response_len)
        metrics = {
            # The micro-batch's own aggregate (not its share), so averaging over micro-batches
            # gives a number on the same scale whatever the micro-batch size.
            "pg_loss": float(aggregate(batch.as_global(), per_token.detach(), cfg.loss_agg,
                                       cfg.max_response_len)),
            "pg_clipfrac": masked_mean(clipped.float(), mask),
            "ppo_kl": masked_mean(old - logprobs, mask),
        }
        if cfg.kl_coef > 0:
            if batch.ref_logprobs is None:
                raise ValueError("grpo: kl_coef > 0 but the batch has no ref_logprobs; the loop "
                                 "should fill them because needs_reference is True")
            kl = kl_estimate(logprobs, batch.ref_logprobs, cfg.kl_estimator)
            loss = loss + cfg.kl_coef * aggregate(batch, kl, cfg.loss_agg, cfg.max_response_len)
            metrics["kl"] = masked_mean(kl, mask)
        return loss, metrics
