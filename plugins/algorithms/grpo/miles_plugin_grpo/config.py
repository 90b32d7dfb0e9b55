"""Settings of the policy-gradient family (pydantic only: importable without torch).

The options every clipped policy loss shares (clipping, aggregation, KL as a loss term or in the
reward, entropy bonus, rollout/trainer mismatch corrections) are ``miles_rlmath``'s
``PolicyLossConfig``; ``GRPOConfig``, ``GSPOConfig`` and ``ReinforcePPConfig`` add what is
specific to each advantage estimator.
"""
from __future__ import annotations

from miles_rlmath.config import KLEstimator, LossAgg, PolicyLossConfig
from pydantic import Field, model_validator


class GRPOConfig(PolicyLossConfig):
    """Settings of the ``grpo`` algorithm (the ``algorithm:`` config section minus ``name``)."""

    std_normalize: bool = Field(True, description=(
        "Divide group-centred rewards by the group's (unbiased) reward std. False is Dr.GRPO's "
        "choice, which avoids up-weighting groups whose rewards barely differ."))
    filter_zero_variance: bool = Field(True, description=(
        "Dynamic sampling: drop groups whose rewards are all equal, since their advantages are "
        "all zero and they only dilute the batch. Groups of a single sample are kept (their "
        "advantage is 0: a lone sample has no baseline but itself)."))
    dr_grpo: bool = Field(False, description=(
        "Dr.GRPO preset: implies std_normalize=False and loss_agg='seq-mean-token-sum-norm'."))

    @model_validator(mode="after")
    def _dr_grpo_preset(self) -> GRPOConfig:
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


class GSPOConfig(GRPOConfig):
    """Settings of ``gspo``: GRPO's advantages with a sequence-level, length-normalised ratio.

    The clip ranges default to the GSPO paper's (3e-4 below, 4e-4 above): a sequence ratio is a
    geometric mean over tokens, so it moves far less than a token ratio.
    """

    clip_low: float = Field(3e-4, description=(
        "Sequence-ratio clip below 1 (ratio clipped at 1 - clip_low); GSPO paper: 3e-4."))
    clip_high: float | None = Field(4e-4, description=(
        "Sequence-ratio clip above 1 (ratio clipped at 1 + clip_high); GSPO paper: 4e-4. "
        "None means the same as clip_low."))
    loss_agg: LossAgg = Field("seq-mean-token-mean", description=(
        "Aggregation; the default averages the per-sequence losses over sequences, as in the "
        "GSPO objective. See grpo's loss_agg for the other modes."))


class ReinforcePPConfig(PolicyLossConfig):
    """Settings of ``reinforce_pp``: REINFORCE++ (or REINFORCE++-baseline) advantages."""

    baseline: bool = Field(False, description=(
        "REINFORCE++-baseline: subtract the group's mean reward from each sample's reward and "
        "use A_t = (r - mean_group r) - kl_reward_coef * kl_t; false is plain REINFORCE++: "
        "per-token rewards -kl_reward_coef * kl_t plus r at the last token, discounted returns. "
        "Both are then whitened over the whole step batch."))
    gamma: float = Field(1.0, gt=0.0, le=1.0, description=(
        "Discount of the per-token returns of plain REINFORCE++ (1 = undiscounted)."))
    kl_reward_coef: float = Field(0.01, ge=0.0, description=(
        "Weight beta of the KL penalty folded into the per-token reward (REINFORCE++'s KL in "
        "reward). 0 disables it and the reference model."))
    kl_estimator: KLEstimator = Field("k1", description=(
        "Per-token KL estimator (lr = logp - ref_logp): 'k1' = lr (the usual in-reward choice), "
        "'k2' = lr^2/2, 'k3' = exp(-lr) - 1 + lr."))
    filter_zero_variance: bool = Field(False, description=(
        "Drop groups whose rewards are all equal. Off by default: plain REINFORCE++ has no group "
        "baseline, so an all-correct group still carries signal after batch whitening."))
