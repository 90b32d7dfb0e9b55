"""Env ``openenv`` and rollout ``openenv``: episodes played on an OpenEnv environment server.

Only the registration hooks live here; the client in ``client``, the env in ``env``, the
multi-step rollout in ``rollout``, the bundled guessing game (an OpenEnv ``Environment``) in ``game``.
"""
from miles import hookimpl


@hookimpl
def miles_register_envs(register):
    from .config import OpenEnvConfig

    register("openenv", _make_env, config=OpenEnvConfig)


@hookimpl
def miles_register_rollouts(register):
    from .config import OpenEnvRolloutConfig

    register("openenv", _make_rollout, config=OpenEnvRolloutConfig)


def _make_env(cfg, *, seed: int = 0, **_):
    from .env import OpenEnvEnv

    return OpenEnvEnv(cfg)


def _make_rollout(cfg, **_):
    from .rollout import OpenEnvRollout

    return OpenEnvRollout(cfg)
