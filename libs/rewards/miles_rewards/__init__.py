"""miles-rewards: the built-in rewards (verifiers) that envs share.

``make_reward(name, settings)`` returns a callable ``reward(response, label, metadata, prompt=...)
-> RewardResult(score, metrics)``; ``name`` is one of ``REWARDS``: ``math``, ``exact``, ``choice``,
``regex``, ``code``, ``judge``. ``mean_metrics(results)`` averages a step's metrics. A library,
not a plugin: it registers nothing and never imports the kernel."""
from .base import REWARDS, Reward, RewardConfigError, RewardResult, make_reward, mean_metrics, validate_settings
from .settings import SETTINGS

__all__ = ["REWARDS", "SETTINGS", "Reward", "RewardConfigError", "RewardResult", "make_reward", "mean_metrics",
           "validate_settings"]
