from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class FlowGRPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    clip_range: float = Field(0.2, gt=0, description="PPO clip range of each denoising step's ratio")
    std_normalize: bool = Field(True, description="divide group-centred rewards by the group's std")
    adv_clip: float | None = Field(5.0, gt=0, description="clip advantages to [-adv_clip, adv_clip] (null = off)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the per-step KL to the reference policy "
                           "(k3 estimator on the transitions' log-probs); > 0 keeps a reference model")
    step_fraction: float = Field(1.0, gt=0, le=1, description="train on the first ceil(fraction * T) "
                                 "denoising steps (the early, high-noise steps decide composition)")
    filter_zero_variance: bool = Field(True, description="drop groups whose images all got the same reward")
    trajectory_key: str = Field("diffusers", description="Sample.extensions key holding the trajectory "
                                "tensors the model spec scores (they become Batch.extras)")


def cross_section_problems(config: Any) -> list[str]:
    """What flow-grpo needs from the rollout: one log-prob per denoising step, which the diffusion
    rollout records only with its SDE sampler (its ODE sampler records none)."""
    if config.name("algorithm") != "flow-grpo" or config.rollout.name != "diffusion":
        return []
    if getattr(config.rollout_settings, "sampler", "sde") != "sde":
        return ["rollout.sampler: algorithm flow-grpo needs the SDE sampler's log-probs: set "
                "rollout.sampler sde (or use algorithm.name diffusion-nft)"]
    return []
