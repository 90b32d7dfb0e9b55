"""miles plugin: the group-based policy-gradient algorithms ``grpo``, ``gspo`` and ``reinforce_pp``.

Only thin hook implementations live here; the torch-using logic is in sibling modules, imported
when an algorithm is built, so discovering plugins stays cheap.

Public API for other distributions (e.g. ``miles-plugin-ppo``), importable from this package and
loaded on first access: the loss math of ``losses`` (``group_advantages``, ``kl_estimate``,
``ppo_clip_loss``, ``aggregate``, ``masked_mean``, ``masked_whiten``, ``gae``, ...), the shared
policy loss of ``policy`` (``policy_loss``, ``reward_kl``) and the settings base class
``PolicyLossConfig``.
"""
from importlib import import_module

from miles import hookimpl

_PUBLIC = {
    **{name: "losses" for name in (
        "group_advantages", "kl_estimate", "ppo_clip_loss", "sequence_log_ratio", "aggregate",
        "masked_mean", "masked_whiten", "last_token_index", "terminal_rewards",
        "discounted_returns", "gae", "value_clip_loss", "tis_weights", "mismatch_keep",
        "sampled_entropy")},
    **{name: "policy" for name in ("policy_loss", "reward_kl", "has_rollout_logprobs")},
    **{name: "config" for name in ("PolicyLossConfig", "GRPOConfig", "GSPOConfig",
                                   "ReinforcePPConfig")},
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    # Lazy (PEP 562): importing the package for plugin discovery must not import torch.
    if name in _PUBLIC:
        return getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _grpo(cfg, **_):
    from .algorithm import GRPO

    return GRPO(cfg)


def _gspo(cfg, **_):
    from .algorithm import GSPO

    return GSPO(cfg)


def _reinforce_pp(cfg, **_):
    from .algorithm import ReinforcePP

    return ReinforcePP(cfg)


@hookimpl
def miles_register_algorithms(register):
    from .config import GRPOConfig, GSPOConfig, ReinforcePPConfig

    register("grpo", _grpo, config=GRPOConfig)
    register("gspo", _gspo, config=GSPOConfig)
    register("reinforce_pp", _reinforce_pp, config=ReinforcePPConfig)
