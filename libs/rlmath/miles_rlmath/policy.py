"""The clipped policy loss with every shared option, and the KL-in-reward penalty.

``policy_loss(batch, logprobs, cfg)`` is what grpo, gspo, reinforce_pp and ppo call from their
``loss``; ``reward_kl(batch, cfg)`` is what their ``prepare`` folds into the reward. ``cfg`` is a
``PolicyLossConfig`` (or any object with its fields); ``batch`` a ``miles.Batch`` (duck-typed).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .kl import kl_estimate
from .masked import aggregate, masked_mean
from .mismatch import any_correction, apply_corrections
from .ratio import ppo_clip_loss, sampled_entropy, sequence_log_ratio

if TYPE_CHECKING:  # pragma: no cover
    from miles import Batch


def has_rollout_logprobs(batch: Batch) -> bool:
    """Whether the samples carry the engine's log-probs (custom rollouts may not)."""
    return bool(batch.samples) and bool(batch.samples[0].logprobs)


def policy_loss(batch: Batch, logprobs: torch.Tensor, cfg: Any, sequence_level: bool = False
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the policy loss, and its metrics.

    PPO-clip on the token ratio (or on GSPO's sequence ratio when ``sequence_level``), then the
    mismatch corrections (TIS, mask, IcePop, sequence MIS/RS: ``mismatch.py``); aggregated with
    ``cfg.loss_agg``; minus the entropy bonus;
    plus the KL loss term. Without ``batch.old_logprobs`` this is the single on-policy update
    (ratio 1, so the gradient is the plain policy gradient).
    """
    mask = batch.loss_mask
    old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    if sequence_level:
        seq_lr = sequence_log_ratio(logprobs, old, mask)
        per_token, clipped = ppo_clip_loss(seq_lr, torch.zeros_like(seq_lr), batch.advantages,
                                           cfg.clip_low, cfg.clip_high_value, cfg.dual_clip_c)
    else:
        per_token, clipped = ppo_clip_loss(logprobs, old, batch.advantages, cfg.clip_low,
                                           cfg.clip_high_value, cfg.dual_clip_c)
    metrics: dict[str, float] = {}
    per_token = _mismatch_corrections(batch, per_token, old, cfg, metrics)
    loss = aggregate(batch, per_token, cfg.loss_agg, cfg.max_response_len)
    metrics.update({
        # The micro-batch's own aggregate (not its share), so averaging over micro-batches
        # gives a number on the same scale whatever the micro-batch size.
        "pg_loss": float(aggregate(batch.as_global(), per_token.detach(), cfg.loss_agg,
                                   cfg.max_response_len)),
        "pg_clipfrac": masked_mean(clipped.float(), mask),
        "ppo_kl": masked_mean(old - logprobs, mask),
    })
    entropy = batch.extras.get("entropy")
    if entropy is None:
        entropy = sampled_entropy(logprobs, old)
    metrics["entropy"] = masked_mean(entropy, mask)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * aggregate(batch, entropy, cfg.loss_agg, cfg.max_response_len)
    if cfg.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 but the batch has no ref_logprobs; the loop fills them "
                             "when the algorithm's needs_reference is True")
        kl = kl_estimate(logprobs, batch.ref_logprobs, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * aggregate(batch, kl, cfg.loss_agg, cfg.max_response_len)
        metrics["kl"] = masked_mean(kl, batch.loss_mask)
    return loss, metrics


def _mismatch_corrections(batch: Batch, per_token: torch.Tensor, old: torch.Tensor, cfg: Any,
                          metrics: dict[str, float]) -> torch.Tensor:
    """Apply the rollout/trainer mismatch corrections (``mismatch.py``) that ``cfg`` turns on."""
    if not any_correction(cfg):
        return per_token
    if not has_rollout_logprobs(batch):
        raise ValueError("tis_cap / mismatch_mask_band / icepop / seq_correction compare the trainer's "
                         "log-probs with the rollout engine's, but these samples carry no log-probs; unset "
                         "them or make the rollout return Sample.logprobs")
    return apply_corrections(batch, per_token, old, cfg, metrics)


def reward_kl(batch: Batch, cfg: Any) -> torch.Tensor:
    """``[B, R]`` per-token KL between the policy that generated the batch and the reference,
    for the KL-in-reward penalty (``kl_t`` of Miles' ``compute_advantages``).

    The generating policy's log-probs are the trainer's recompute when the loop made one
    (``old_logprobs``), else the engine's (as Miles' ``--use-rollout-logprobs``).
    """
    if batch.ref_logprobs is None:
        raise ValueError("kl_reward_coef > 0 but the batch has no ref_logprobs; the loop fills "
                         "them when the algorithm's needs_reference is True")
    if batch.old_logprobs is not None:
        base = batch.old_logprobs
    elif has_rollout_logprobs(batch):
        base = batch.rollout_logprobs
    else:
        raise ValueError("kl_reward_coef > 0 needs the generating policy's log-probs: the samples "
                         "carry none and the batch has no old_logprobs")
    return kl_estimate(base, batch.ref_logprobs, cfg.kl_estimator) * batch.loss_mask
