"""On-policy distillation settings (pydantic only: importable without torch)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# how the teacher of recipes/distill.yaml is made; named in the error for a missing folder
MAKE_TEACHER = "miles train recipes/sft.yaml && miles export runs/sft --to runs/sft/export"


class DistillConfig(BaseModel):
    """Settings of the ``distill`` algorithm (the ``algorithm:`` config section minus ``name``)."""

    model_config = ConfigDict(extra="forbid")

    teacher: str = Field(..., description=(
        "the teacher: a Hugging Face causal LM folder (config, weights, tokenizer) sharing the "
        f"student's vocabulary, e.g. one written by `miles export` (`{MAKE_TEACHER}`)"))
    teacher_device: str = Field("cpu", description="where the teacher runs: cpu, cuda, cuda:N or auto")
    teacher_batch_size: int = Field(512, gt=0, description="sequences per teacher forward pass")
    kl_coef: float = Field(1.0, ge=0, description=(
        "weight of the distillation advantage -(logp_student - logp_teacher) of each token"))
    reward_coef: float = Field(0.0, ge=0, description=(
        "weight of the env reward's group-normalised advantage added to it (0 = pure distillation; "
        ">0 = RL with a distillation term)"))
    std_normalize: bool = Field(True, description="divide the reward advantage by the group's reward std")
    clip_low: float = Field(0.2, gt=0, lt=1, description="PPO clip below 1 (matters with rollout.minibatches > 1)")
    clip_high: float = Field(0.28, gt=0, description="PPO clip above 1")
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = Field(
        "token-mean", description="how per-token losses are averaged over the step")

    @field_validator("teacher")
    @classmethod
    def _teacher_folder_exists(cls, v: str) -> str:
        p = Path(v)
        if not p.is_dir():
            raise ValueError(f"teacher folder {v} does not exist; create a teacher first, e.g. "
                             f"`{MAKE_TEACHER}`, or point algorithm.teacher at a Hugging Face model folder")
        if not (p / "config.json").is_file():
            raise ValueError(f"teacher folder {v} has no config.json: it is not a Hugging Face model "
                             f"folder (`miles export RUN --to FOLDER` writes one)")
        return v
