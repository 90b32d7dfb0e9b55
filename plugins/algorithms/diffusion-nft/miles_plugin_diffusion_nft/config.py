from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class DiffusionNFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    beta: float = Field(1.0, gt=0, description="guidance strength: the implicit policies are "
                        "v+ = (1 - beta) v_old + beta v and v- = (1 + beta) v_old - beta v")
    ema_decay: float = Field(0.8, ge=0, lt=1, description="the old policy is an EMA of the trained "
                             "weights, old <- ema_decay * old + (1 - ema_decay) * new, once per step "
                             "(0: the weights that sampled the step's images; a lagging old policy "
                             "anchors the update)")
    noise_draws: int = Field(4, ge=1, description="noised copies x_t of each clean sample per step "
                             "(each with its own noise level and noise)")
    shift: float = Field(1.0, gt=0, description="noise levels sigma = shift*u / (1 + (shift-1)*u), "
                         "u ~ U(0, 1): 1 is uniform, > 1 favours high noise (as the sampler's schedule)")
    reward_norm: Literal["group", "batch"] = Field("group", description="the std Z in the optimality "
                                                   "probability r = 1/2 + 1/2 clip((reward - group mean) "
                                                   "/ Z, -1, 1): the prompt group's or the whole step's")
    filter_zero_variance: bool = Field(False, description="drop groups whose images all got the same "
                                       "reward (kept, they have r = 1/2 and only pull v toward v_old)")
    seed: int = Field(0, description="seed of the noise levels and noise of the forward process")
    trajectory_key: str = Field("diffusers", description="Sample.extensions key holding the rollout's "
                                "trajectory (final latents, conditioning)")


def cross_section_problems(config: Any) -> list[str]:
    if config.name("algorithm") != "diffusion-nft":
        return []
    problems = []
    if config.rollout.name != "diffusion":
        problems.append(f"rollout.name: algorithm diffusion-nft trains on images: set rollout.name "
                        f"diffusion (not {config.rollout.name!r})")
    if config.rollout.temperature <= 0:
        problems.append("rollout.temperature: algorithm diffusion-nft needs rollouts from random noise "
                        "(temperature > 0); temperature 0 samples each prompt's fixed evaluation noise")
    return problems
