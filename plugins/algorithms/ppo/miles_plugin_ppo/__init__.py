"""miles plugin: PPO with a learned critic (registered as ``"ppo"``).

Thin hooks only; ``algorithm.py`` (torch) is imported when the algorithm is built.
"""
from miles import hookimpl


def _make(cfg, **_):
    from .algorithm import PPO

    return PPO(cfg)


@hookimpl
def miles_register_algorithms(register):
    from .config import PPOConfig

    register("ppo", _make, config=PPOConfig)
