"""miles-rlmath: the RL math that several miles algorithms share (a library, not a plugin).

Modules (each name is also importable from the package, loaded on first access so that importing
``miles_rlmath`` or ``miles_rlmath.config`` does not import torch):

* ``advantages``: ``group_advantages`` (GRPO / Dr.GRPO / REINFORCE++-baseline group baselines,
  the single-sample-group rule), ``terminal_rewards``, ``discounted_returns``, ``gae``;
* ``masked``: ``masked_mean``, ``row_mean``, ``masked_whiten``, ``aggregate`` (token-mean,
  seq-mean-token-mean, Dr.GRPO's seq-mean-token-sum-norm over a step's micro-batches);
* ``kl``: ``kl_estimate`` (k1, k2, k3 = low_var_kl, clamped as verl clamps it);
* ``ratio``: ``clamped_log_ratio``, ``ppo_clip_loss``, ``sequence_log_ratio`` (GSPO),
  ``tis_weights``, ``mismatch_keep``, ``sampled_entropy``;
* ``mismatch``: the rollout/trainer mismatch corrections beside TIS: ``icepop_weights``,
  ``sequence_ratio``, ``sequence_weights`` (sequence-level MIS / RS), ``apply_corrections``;
* ``value``: ``value_clip_loss``, ``explained_variance``;
* ``policy``: ``policy_loss`` (the clipped policy loss with every shared option) and ``reward_kl``;
* ``logprobs``: ``token_logprobs`` (chosen tokens' log-probs from a model's logits; fused Triton
  kernels on CUDA, no float32 copy of the logits), ``fused_available``;
* ``config``: ``PolicyLossConfig``, the pydantic settings of that loss (torch-free).

Tensors are ``[B, R]`` over a batch's actions (response tokens) with a ``loss_mask`` of the same
shape; functions that aggregate over a training step take a ``miles.Batch`` (duck-typed: this
library never imports the kernel).
"""
from importlib import import_module

_MODULES = {
    "advantages": ("STD_EPS", "group_advantages", "last_token_index", "terminal_rewards",
                   "discounted_returns", "gae"),
    "masked": ("WHITEN_EPS", "masked_mean", "row_mean", "masked_whiten", "aggregate", "LOSS_AGGS"),
    "kl": ("KL_CLAMP", "KL_ESTIMATORS", "kl_estimate"),
    "ratio": ("LOG_RATIO_CLAMP", "SEQ_LOG_RATIO_MAX", "clamped_log_ratio", "ppo_clip_loss", "sequence_log_ratio",
              "tis_weights", "mismatch_keep", "sampled_entropy"),
    "mismatch": ("token_ratio", "icepop_weights", "sequence_ratio", "sequence_weights", "apply_corrections"),
    "value": ("value_clip_loss", "explained_variance"),
    "policy": ("policy_loss", "reward_kl", "has_rollout_logprobs"),
    "logprobs": ("token_logprobs", "fused_available"),
    "config": ("PolicyLossConfig", "LossAgg", "KLEstimator"),
}
_PUBLIC = {name: module for module, names in _MODULES.items() for name in names}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    # PEP 562: plugins import this package while being discovered; torch loads on first use.
    if name in _PUBLIC:
        return getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
