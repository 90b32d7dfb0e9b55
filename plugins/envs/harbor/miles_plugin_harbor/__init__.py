"""Env ``harbor`` and rollout ``harbor``: training on trials run by a Harbor server.

Only the registration hooks live here: the client of ``harbor serve``'s HTTP API in ``client``,
the task folders in ``env``, jobs and their rollouts as samples in ``rollout``, starting the
server (and a local container image for the bundled tasks) in ``launch``.
"""
from miles import hookimpl


@hookimpl
def miles_register_envs(register):
    from .config import HarborConfig

    register("harbor", _make_env, config=HarborConfig)


@hookimpl
def miles_register_rollouts(register):
    from .config import HarborRolloutConfig

    register("harbor", _make_rollout, config=HarborRolloutConfig)


def _make_env(cfg, **_):
    from .env import HarborEnv

    return HarborEnv(cfg)


def _make_rollout(cfg, **_):
    from .rollout import HarborRollout

    return HarborRollout(cfg)
