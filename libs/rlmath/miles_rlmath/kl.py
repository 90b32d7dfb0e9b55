"""Per-token KL estimators (Schulman's k1/k2/k3), with verl's numerical guards on k3."""
from __future__ import annotations

import torch

from .ratio import LOG_RATIO_CLAMP

# k3 is clamped to this range (as verl's low_var_kl): a token whose estimate exceeds 10 has a
# policy/reference ratio beyond e^12, where the estimate is all variance and its gradient (the
# ratio itself) would swamp every other token of the step.
KL_CLAMP = 10.0
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from tokens sampled from the policy, with
    ``lr = logprobs - ref_logprobs``:

    * ``k1 = lr`` (unbiased, can be negative);
    * ``k2 = lr^2 / 2``;
    * ``k3 = exp(-lr) - 1 + lr`` (unbiased and non-negative), computed with ``-lr`` clamped to
      ``[-20, 20]`` and the result clamped to ``[-10, 10]`` as verl's ``low_var_kl`` (an alias
      here): where the two models disagree wildly the value stays at most 10 and the gradient
      stays finite (0 beyond the clamp) instead of ``e^20``.
    """
    lr = logprobs - ref_logprobs
    if kind == "k1":
        return lr
    if kind == "k2":
        return lr.pow(2) / 2
    if kind in ("k3", "low_var_kl"):
        neg = (-lr).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(neg) - 1 - neg).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_ESTIMATORS)}")
