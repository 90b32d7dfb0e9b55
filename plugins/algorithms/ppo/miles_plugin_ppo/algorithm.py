"""PPO with a critic: GAE advantages from a learned value model, clipped value loss.

The loop gives this algorithm (``needs_critic = True``) the critic's values in
``batch.extras['values']`` before the update, calls ``prepare`` once on the whole batch (GAE,
returns), then per mini-batch ``loss`` (policy, via the trainer's ``train_step``) and
``value_loss`` (critic, via the trainer's ``train_critic``).

Formulas (Miles' ``compute_advantages``/``value_loss_function``; GAE of Schulman et al. 2016):
token rewards ``r_t = -beta * kl_t`` plus the outcome reward at the last trainable token;
``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``, ``R_t = A_t + V_t``;
value loss ``max((V - R)^2, (V_old + clip(V - V_old, +-eps_v) - R)^2)``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from miles import Batch, Group
from miles_rlmath.advantages import gae, terminal_rewards
from miles_rlmath.masked import aggregate, masked_mean, masked_whiten, row_mean
from miles_rlmath.policy import policy_loss, reward_kl
from miles_rlmath.value import explained_variance, value_clip_loss

from .config import PPOConfig


class PPO:
    """Proximal Policy Optimization with a value model, implementing ``miles.protocols.Algorithm``."""

    uses_rollout = True
    needs_critic = True

    def __init__(self, cfg: PPOConfig | None = None):
        self.cfg = cfg if cfg is not None else PPOConfig()

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0 or self.cfg.kl_reward_coef > 0

    @property
    def critic_lr(self) -> float | None:
        """Read by the trainer when it builds the critic's optimizer (None: its own lr)."""
        return self.cfg.critic_lr

    def keep(self, group: Group) -> bool:
        # The critic is the baseline: a group whose rewards are all equal still teaches it and,
        # through A = R - V, the policy.
        return True

    def advantages(self, groups: Sequence[Group]) -> list[list[float]]:
        """The outcome reward of each sample; ``prepare`` turns it into per-token GAE."""
        return [g.rewards for g in groups]

    def prepare(self, batch: Batch) -> dict[str, float]:
        cfg, mask = self.cfg, batch.loss_mask
        values = batch.extras.get("values")
        if values is None:
            raise ValueError("ppo needs the critic's values in batch.extras['values']; the loop "
                             "asks the trainer for them when an algorithm declares needs_critic = True")
        values = values * mask
        outcome = row_mean(batch.advantages, mask)
        rewards = terminal_rewards(outcome, mask)
        metrics = {}
        if cfg.kl_reward_coef > 0:
            kl = reward_kl(batch, cfg)
            rewards = rewards - cfg.kl_reward_coef * kl
            metrics["kl_reward"] = masked_mean(kl, mask)
        adv, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        batch.extras["returns"] = returns
        batch.advantages = masked_whiten(adv, mask) if cfg.normalize_advantages else adv
        metrics.update(value_mean=masked_mean(values, mask), return_mean=masked_mean(returns, mask),
                       gae_adv_mean=masked_mean(adv, mask),
                       explained_variance=explained_variance(values, returns, mask))
        return metrics

    def loss(self, batch: Batch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return policy_loss(batch, logprobs, self.cfg)

    def value_loss(self, batch: Batch, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the clipped value loss; ``values`` ``[B, R]`` has grad."""
        cfg, mask = self.cfg, batch.loss_mask
        per_token, clipped = value_clip_loss(values, batch.extras["values"], batch.extras["returns"],
                                             cfg.value_clip)
        loss = aggregate(batch, per_token, cfg.loss_agg, cfg.max_response_len)
        return loss, {
            "value_loss": float(aggregate(batch.as_global(), per_token.detach(), cfg.loss_agg,
                                          cfg.max_response_len)),
            "value_clipfrac": masked_mean(clipped.float(), mask),
            "value_pred_mean": masked_mean(values, mask)}

