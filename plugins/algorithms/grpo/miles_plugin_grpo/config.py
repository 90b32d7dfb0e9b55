"""GRPO configuration (pydantic only: importable without torch)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]


class GRPOConfig(BaseModel):
    """Settings of the ``grpo`` algorithm (the ``algorithm:`` config section minus ``name``)."""

    model_config = ConfigDict(extra="forbid")

    clip_low: float = Field(0.2, description=(
        "PPO clip range epsilon below 1: the ratio pi/pi_old is clipped at 1 - clip_low. "
        "Must lie in (0, 1)."))
    clip_high: float | None = Field(None, description=(
        "Clip range above 1 (ratio clipped at 1 + clip_high). None means the same as clip_low; "
        "a larger value is DAPO's clip-higher, which lets low-probability tokens grow faster."))
    std_normalize: bool = Field(True, description=(
        "Divide group-centred rewards by the group's (unbiased) reward std. False is Dr.GRPO's "
        "choice, which avoids up-weighting groups whose rewards barely differ."))
    loss_agg: LossAgg = Field("token-mean", description=(
        "How per-token losses become one number: 'token-mean' averages over all trainable "
        "tokens of the step; 'seq-mean-token-mean' averages each sequence's token-mean over "
        "sequences; 'seq-mean-token-sum-norm' (Dr.GRPO) sums each sequence's tokens, divides by "
        "the constant max_response_len, and averages over sequences."))
    max_response_len: int = Field(1024, gt=0, description=(
        "The constant divisor of 'seq-mean-token-sum-norm' (Dr.GRPO); usually the rollout's "
        "max_new_tokens. Ignored by the other aggregations."))
    kl_coef: float = Field(0.0, ge=0.0, description=(
        "Weight of the KL(policy || reference) penalty added to the loss. 0 disables it and the "
        "reference model is then not needed."))
    kl_estimator: KLEstimator = Field("k3", description=(
        "Per-token KL estimator with lr = logp - ref_logp: 'k1' = lr, 'k2' = lr^2/2, "
        "'k3' = exp(-lr) - 1 + lr (unbiased and non-negative)."))
    filter_zero_variance: bool = Field(True, description=(
        "Dynamic sampling: drop groups whose rewards are all equal, since their advantages are "
        "all zero and they only dilute the batch. Groups of a single sample are kept."))
    dual_clip_c: float | None = Field(None, description=(
        "Dual-clip constant c (> 1): for negative advantages the per-token loss is capped at "
        "-c * A so a huge ratio cannot blow up the update. None disables it."))
    dr_grpo: bool = Field(False, description=(
        "Dr.GRPO preset: implies std_normalize=False and loss_agg='seq-mean-token-sum-norm'."))

    @field_validator("clip_low")
    @classmethod
    def _clip_low_in_unit_interval(cls, v: float) -> float:
        if not 0.0 < v < 1.0:
            raise ValueError(f"clip_low must be in (0, 1), got {v}")
        return v

    @field_validator("dual_clip_c")
    @classmethod
    def _dual_clip_above_one(cls, v: float | None) -> float | None:
        if v is not None and v <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 when set (it caps the loss at -c*A), got {v}")
        return v

    @model_validator(mode="after")
    def _check_combinations(self) -> "GRPOConfig":
        if self.clip_high is not None and self.clip_high < self.clip_low:
            raise ValueError(f"clip_high ({self.clip_high}) must be >= clip_low ({self.clip_low}); "
                             f"leave clip_high unset for a symmetric clip range")
        if self.dr_grpo:
            # An explicit setting that contradicts the preset is a mistake, not something to
            # silently override.
            if "std_normalize" in self.model_fields_set and self.std_normalize:
                raise ValueError("dr_grpo=true implies std_normalize=false; do not set both")
            if "loss_agg" in self.model_fields_set and self.loss_agg != "seq-mean-token-sum-norm":
                raise ValueError(f"dr_grpo=true implies loss_agg='seq-mean-token-sum-norm', "
                                 f"got loss_agg={self.loss_agg!r}")
            self.std_normalize = False
            self.loss_agg = "seq-mean-token-sum-norm"
        return self

    @property
    def clip_high_value(self) -> float:
        """The upper clip range actually used (clip_low when clip_high is unset)."""
        return self.clip_low if self.clip_high is None else self.clip_high
