"""miles plugin: the GRPO algorithm (registered as ``"grpo"``).

Only thin hook implementations live here; the torch-using logic is in ``algorithm.py`` and is
imported when an algorithm is actually built, so discovering plugins stays cheap.
"""
from miles import hookimpl


def _make(cfg, **ctx):
    from .algorithm import GRPO

    return GRPO(cfg)


@hookimpl
def miles_register_algorithms(register):
    from .config import GRPOConfig

    register("grpo", _make, config=GRPOConfig)
