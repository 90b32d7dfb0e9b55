"""Settings of the shared clipped policy loss (pydantic only: importable without torch).

``PolicyLossConfig`` holds the options every clipped policy loss shares (clipping, aggregation,
KL as a loss term or in the reward, entropy bonus, rollout/trainer mismatch corrections: TIS,
the mismatch mask, IcePop, sequence-level MIS / RS);
algorithm plugins (grpo, gspo, reinforce_pp, ppo) extend it with their own settings.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
SeqCorrection = Literal["mis", "rs"]
SeqRatio = Literal["geometric", "product"]


class PolicyLossConfig(BaseModel):
    """Options of the clipped policy loss shared by grpo, gspo, reinforce_pp and ppo."""

    model_config = ConfigDict(extra="forbid")

    clip_low: float = Field(0.2, description=(
        "PPO clip range epsilon below 1: the ratio pi/pi_old is clipped at 1 - clip_low. "
        "Must lie in (0, 1)."))
    clip_high: float | None = Field(None, description=(
        "Clip range above 1 (ratio clipped at 1 + clip_high). None means the same as clip_low; "
        "a larger value is DAPO's clip-higher, which lets low-probability tokens grow faster."))
    dual_clip_c: float | None = Field(None, description=(
        "Dual-clip constant c (> 1): for negative advantages the per-token loss is capped at "
        "-c * A so a huge ratio cannot blow up the update. None disables it."))
    loss_agg: LossAgg = Field("token-mean", description=(
        "How per-token losses become one number: 'token-mean' averages over all trainable "
        "tokens of the step; 'seq-mean-token-mean' averages each sequence's token-mean over "
        "sequences; 'seq-mean-token-sum-norm' (Dr.GRPO) sums each sequence's tokens, divides by "
        "the constant max_response_len, and averages over sequences."))
    max_response_len: int = Field(1024, gt=0, description=(
        "The constant divisor of 'seq-mean-token-sum-norm' (Dr.GRPO); usually the rollout's "
        "max_new_tokens. Ignored by the other aggregations."))
    kl_coef: float = Field(0.0, ge=0.0, description=(
        "Weight of the KL(policy || reference) penalty added to the LOSS. 0 disables it."))
    kl_reward_coef: float = Field(0.0, ge=0.0, description=(
        "Weight beta of the KL penalty folded into the REWARD: every trainable token gets "
        "-beta * kl_t (kl_t estimated between the rollout policy and the reference) before "
        "advantages are formed. 0 disables it. The reference model is needed when this or "
        "kl_coef is > 0."))
    kl_estimator: KLEstimator = Field("k3", description=(
        "Per-token KL estimator with lr = logp - ref_logp: 'k1' = lr, 'k2' = lr^2/2, "
        "'k3' = exp(-lr) - 1 + lr (unbiased and non-negative; -lr clamped to [-20, 20] and the "
        "value to [-10, 10], as verl's low_var_kl). Used by kl_coef and kl_reward_coef."))
    entropy_coef: float = Field(0.0, ge=0.0, description=(
        "Entropy bonus: loss -= entropy_coef * H. H is the trainer's exact per-token entropy when "
        "it puts one in batch.extras['entropy'], else an unbiased estimate from the sampled "
        "tokens (miles_rlmath.sampled_entropy). 0 disables it."))
    tis_cap: float | None = Field(None, gt=0.0, description=(
        "Truncated importance sampling against the rollout engine's log-probs: each token's "
        "policy loss is multiplied by min(exp(old_logp - rollout_logp), tis_cap) (Miles uses 2.0). "
        "None disables it."))
    mismatch_mask_band: tuple[float, float] | None = Field(None, description=(
        "[low, high]: tokens whose trainer/rollout ratio exp(old_logp - rollout_logp) leaves this "
        "band are dropped from the policy loss (numerator only; denominators stay the step's). "
        "Needs low <= 1 <= high. None disables it."))
    icepop: tuple[float, float] | None = Field(None, description=(
        "IcePop [low, high]: each token's policy loss is multiplied by its trainer/rollout ratio "
        "exp(old_logp - rollout_logp) where that lies in [low, high], and by 0 outside (the IcePop "
        "paper uses [0.5, 5]). Metrics icepop_masked_frac, icepop_weight_mean. Not with tis_cap "
        "(both weight by the same ratio). None disables it."))
    seq_correction: SeqCorrection | None = Field(None, description=(
        "Sequence-level mismatch correction: 'mis' (masked importance sampling: the whole "
        "sequence's loss times its trainer/rollout ratio inside seq_band, 0 outside) or 'rs' "
        "(rejection sampling: the sequence is dropped outside seq_band, no weight). Metrics "
        "seq_ratio_mean/min/max, seq_rejected_frac. None disables it."))
    seq_ratio: SeqRatio = Field("geometric", description=(
        "The sequence ratio of seq_correction: 'geometric' = exp(mean over tokens of the log "
        "ratio), 'product' = exp(sum), the sequence's likelihood ratio (needs a wider seq_band)."))
    seq_band: tuple[float, float] = Field((0.5, 2.0), description=(
        "[low, high] of seq_correction: sequences whose ratio leaves it are dropped "
        "(0 <= low <= 1 <= high)."))
    seq_veto: float | None = Field(None, gt=0.0, lt=1.0, description=(
        "With seq_correction: a sequence holding any trainable token whose ratio is below this is "
        "dropped, however its other tokens average out (e.g. 1e-4). None disables it."))

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

    @field_validator("mismatch_mask_band", "icepop", "seq_band")
    @classmethod
    def _band_contains_one(cls, v: tuple[float, float] | None, info) -> tuple[float, float] | None:
        if v is not None and not 0.0 <= v[0] <= 1.0 <= v[1]:
            raise ValueError(f"{info.field_name} must be [low, high] with 0 <= low <= 1 <= high "
                             f"(a ratio of 1 means no mismatch), got {list(v)}")
        return v

    @model_validator(mode="after")
    def _clip_order(self) -> PolicyLossConfig:
        if self.clip_high is not None and self.clip_high < self.clip_low:
            raise ValueError(f"clip_high ({self.clip_high}) must be >= clip_low ({self.clip_low}); "
                             f"leave clip_high unset for a symmetric clip range")
        # TIS, IcePop and MIS each multiply the loss by an importance ratio: two of them would
        # weight a token twice by the same mismatch
        weights = [k for k, on in (("tis_cap", self.tis_cap is not None), ("icepop", self.icepop is not None),
                                   ("seq_correction: mis", self.seq_correction == "mis")) if on]
        if len(weights) > 1:
            raise ValueError(f"{' and '.join(weights)} both weight the loss by the trainer/rollout ratio; "
                             f"keep one (seq_correction: rs or mismatch_mask_band only mask, and combine "
                             f"with any)")
        return self

    @property
    def clip_high_value(self) -> float:
        """The upper clip range actually used (clip_low when clip_high is unset)."""
        return self.clip_low if self.clip_high is None else self.clip_high
