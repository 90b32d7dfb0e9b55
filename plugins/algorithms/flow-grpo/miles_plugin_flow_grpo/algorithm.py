"""Flow-GRPO (arXiv 2505.05470): GRPO over the denoising steps of flow-matching samples.

A sample's actions are its T SDE transitions. Advantages are group-normalised rewards broadcast
over the steps (``miles_rlmath.group_advantages``, as in the GRPO family); the loss is PPO's
clipped surrogate on each step's probability ratio; the batch
is not made of tokens: ``make_batch`` stacks the trajectory tensors into ``Batch.extras`` for the
model spec's ``action_logprobs``.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from miles import Batch, Group, MilesError, Sample
from miles_rlmath import clamped_log_ratio, group_advantages, kl_estimate, ppo_clip_loss

from .config import FlowGRPOConfig


def clipped_loss(logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                 clip: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-step PPO surrogate ``[B, T]`` (``miles_rlmath.ppo_clip_loss``: the log-ratio clamped
    before ``exp``), the ratio and where the clip was active."""
    per_step, clipped = ppo_clip_loss(logprobs, old, adv, clip)
    return per_step, torch.exp(clamped_log_ratio(logprobs, old)), clipped.float()


class FlowGRPO:
    uses_rollout = True
    needs_critic = False

    def __init__(self, cfg: FlowGRPOConfig | None = None):
        self.cfg = cfg or FlowGRPOConfig()

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    def keep(self, group: Group) -> bool:
        r = group.rewards
        return not (self.cfg.filter_zero_variance and len(r) > 1 and all(x == r[0] for x in r))

    def advantages(self, groups: Sequence[Group]) -> list[list[float]]:
        out = []
        for g in groups:
            adv = group_advantages(g.rewards, self.cfg.std_normalize)
            if self.cfg.adv_clip is not None:
                adv = [max(-self.cfg.adv_clip, min(self.cfg.adv_clip, a)) for a in adv]
            out.append(adv)
        return out

    def make_batch(self, samples: Sequence[Sample], pad_id: int = 0, advantages: Sequence[Any] | None = None) -> Batch:
        """A non-token batch: ``loss_mask``/``advantages``/``rollout_logprobs`` ``[B, T]`` over the
        denoising steps (the first ``step_fraction`` of them trained), trajectories in ``extras``."""
        T = len(samples[0].logprobs)
        if T == 0 or any(len(s.logprobs) != T for s in samples):
            raise MilesError("algorithm 'flow-grpo' needs samples with one log-prob per denoising step, "
                             "the same number for all (use rollout.name: diffusion with an SDE sampler)")
        k = math.ceil(self.cfg.step_fraction * T)
        steps = torch.tensor([1.0] * k + [0.0] * (T - k))
        mask = torch.tensor([list(s.loss_mask) for s in samples], dtype=torch.float) * steps
        adv = torch.tensor([float(a) for a in (advantages if advantages is not None else [0.0] * len(samples))])
        return Batch(input_ids=None, attention_mask=None, position_ids=None, prompt_len=0, loss_mask=mask,
                     advantages=adv[:, None] * mask, rollout_logprobs=torch.tensor([s.logprobs for s in samples]),
                     rewards=torch.tensor([float(s.reward or 0.0) for s in samples]), samples=list(samples),
                     global_tokens=float(mask.sum().clamp(min=1)), global_samples=len(samples),
                     extras=self._extras(samples))

    def _extras(self, samples: Sequence[Sample]) -> dict[str, Any]:
        key = self.cfg.trajectory_key
        if any(key not in s.extensions for s in samples):
            raise MilesError(f"algorithm 'flow-grpo': a sample has no extensions[{key!r}] trajectory; set "
                             f"algorithm.trajectory_key to the rollout's key")
        first = samples[0].extensions[key]
        extras = {n: torch.stack([s.extensions[key][n] for s in samples])
                  for n, v in first.items() if isinstance(v, torch.Tensor)}
        extras.update({n: v for n, v in first.items() if isinstance(v, (int, float, bool))})
        return extras

    def loss(self, batch: Batch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
        per_step, ratio, clipped = clipped_loss(logprobs, old, batch.advantages, self.cfg.clip_range)
        loss = batch.token_mean(per_step)
        m = batch.loss_mask
        denom = float(m.sum().clamp(min=1))
        metrics = {"pg_loss": float(loss.detach()), "clipfrac": float((clipped * m).sum()) / denom,
                   "ratio_mean": float((ratio.detach() * m).sum()) / denom}
        if self.cfg.kl_coef > 0 and batch.ref_logprobs is not None:
            kl = batch.token_mean(kl_estimate(logprobs, batch.ref_logprobs, "k3"))  # clamped as verl
            loss = loss + self.cfg.kl_coef * kl
            metrics["kl"] = float(kl.detach())
        return loss, metrics
