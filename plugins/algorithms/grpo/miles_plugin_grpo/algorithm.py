"""The group-based policy-gradient algorithms: GRPO, GSPO and REINFORCE++(-baseline).

Each implements ``miles.protocols.Algorithm`` plus the optional ``prepare(batch)`` step, which
the loop calls once per step on the whole batch (after reference/old log-probs are filled, before
any optimizer step): that is where token-level work that needs those tensors happens (KL in the
reward, batch whitening).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from miles import Batch, Group
from miles_rlmath.advantages import (
    discounted_returns,
    group_advantages,
    terminal_rewards,
)
from miles_rlmath.masked import masked_mean, masked_whiten, row_mean
from miles_rlmath.policy import policy_loss, reward_kl

from .config import GRPOConfig, GSPOConfig, ReinforcePPConfig


def _all_equal(rewards: list[float]) -> bool:
    return all(r == rewards[0] for r in rewards)


class GRPO:
    """Group Relative Policy Optimization: group-normalised outcome advantages, token PPO-clip."""

    uses_rollout = True
    sequence_level = False
    needs_critic = False

    def __init__(self, cfg: GRPOConfig | None = None):
        self.cfg = cfg if cfg is not None else GRPOConfig()

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0 or self.cfg.kl_reward_coef > 0

    def keep(self, group: Group) -> bool:
        rewards = group.rewards
        if not self.cfg.filter_zero_variance or len(rewards) < 2:
            return True
        return not _all_equal(rewards)

    def advantages(self, groups: Sequence[Group]) -> list[list[float]]:
        return [group_advantages(g.rewards, self.cfg.std_normalize) for g in groups]

    def prepare(self, batch: Batch) -> dict[str, float]:
        """KL in the reward: ``A_t = A_i - kl_reward_coef * kl_t`` (as Miles' REINFORCE++-baseline
        treats its group-centred reward)."""
        if self.cfg.kl_reward_coef <= 0:
            return {}
        kl = reward_kl(batch, self.cfg)
        batch.advantages = (batch.advantages - self.cfg.kl_reward_coef * kl) * batch.loss_mask
        return {"kl_reward": masked_mean(kl, batch.loss_mask)}

    def loss(self, batch: Batch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return policy_loss(batch, logprobs, self.cfg, sequence_level=self.sequence_level)


class GSPO(GRPO):
    """Group Sequence Policy Optimization (Zheng et al. 2025): GRPO's group-normalised
    advantages, with the importance ratio and its clipping at the sequence level:
    ``s_i = exp(mean_t(logp - old_logp))`` (Miles' GSPO ``ppo_kl``), loss
    ``max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high))`` per sequence."""

    sequence_level = True

    def __init__(self, cfg: GSPOConfig | None = None):
        super().__init__(cfg if cfg is not None else GSPOConfig())


class ReinforcePP(GRPO):
    """REINFORCE++ and REINFORCE++-baseline, with Miles' formulas (``compute_advantages``):

    * plain: token rewards ``-beta * kl_t`` plus the outcome ``r`` at the last trainable token,
      ``G_t = r_t + gamma * G_{t+1}``, ``A = G``;
    * baseline: ``A_t = (r - mean_group(r)) - beta * kl_t``;

    then ``A`` is whitened over every trainable token of the step batch (mandatory for
    REINFORCE++). ``beta`` is ``kl_reward_coef``; ``kl_t`` compares the generating policy with
    the reference. The policy loss is the shared token-level PPO-clip.
    """

    def __init__(self, cfg: ReinforcePPConfig | None = None):
        super().__init__(cfg if cfg is not None else ReinforcePPConfig())

    def advantages(self, groups: Sequence[Group]) -> list[list[float]]:
        """The per-sample outcome: ``r`` (plain) or ``r - mean_group(r)`` (baseline); the token
        advantages are formed in ``prepare`` once the reference log-probs exist."""
        if not self.cfg.baseline:
            return [g.rewards for g in groups]
        return [group_advantages(g.rewards, std_normalize=False) for g in groups]

    def prepare(self, batch: Batch) -> dict[str, float]:
        cfg, mask = self.cfg, batch.loss_mask
        # the per-sample scalar that advantages() put in, broadcast over its tokens
        outcome = row_mean(batch.advantages, mask)
        kl = reward_kl(batch, cfg) if cfg.kl_reward_coef > 0 else torch.zeros_like(mask)
        if cfg.baseline:
            adv = (outcome.unsqueeze(-1) - cfg.kl_reward_coef * kl) * mask
        else:
            token_rewards = terminal_rewards(outcome, mask) - cfg.kl_reward_coef * kl
            adv = discounted_returns(token_rewards, mask, cfg.gamma)
        metrics = {"return_mean": masked_mean(adv, mask)}
        if cfg.kl_reward_coef > 0:
            metrics["kl_reward"] = masked_mean(kl, mask)
        batch.advantages = masked_whiten(adv, mask)
        return metrics
