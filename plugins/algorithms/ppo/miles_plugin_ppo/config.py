"""PPO settings (pydantic only: importable without torch)."""
from __future__ import annotations

from miles_rlmath.config import PolicyLossConfig
from pydantic import Field


class PPOConfig(PolicyLossConfig):
    """Settings of ``ppo``: the shared clipped policy loss (clip ranges, entropy bonus, KL in the
    loss or in the reward, TIS, mismatch mask) plus the critic and GAE."""

    gamma: float = Field(1.0, gt=0.0, le=1.0, description="GAE discount per response token")
    lam: float = Field(0.95, ge=0.0, le=1.0, description=(
        "GAE lambda: 1 gives Monte-Carlo returns minus the value (low bias, high variance), "
        "0 gives one-step TD errors (leans on the critic)."))
    value_clip: float | None = Field(0.2, gt=0.0, description=(
        "Clip range of the value update: V is kept within +-value_clip of the value at rollout "
        "time, taking the larger of the clipped and unclipped squared errors. None disables it."))
    critic_lr: float | None = Field(None, gt=0.0, description=(
        "AdamW learning rate of the critic (its own optimizer). None uses the trainer's lr."))
    normalize_advantages: bool = Field(True, description=(
        "Whiten the GAE advantages over every trainable token of the step batch."))
