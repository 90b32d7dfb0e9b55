"""miles plugin: the group-based policy-gradient algorithms ``grpo``, ``gspo`` and ``reinforce_pp``.

Only thin hook implementations live here; the torch-using logic is in ``algorithm.py``, imported
when an algorithm is built, so discovering plugins stays cheap. The loss math is the
``miles-rlmath`` library's (``miles_rlmath``).
"""
from miles import hookimpl


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
    register("reinforce-pp", _reinforce_pp, config=ReinforcePPConfig)
