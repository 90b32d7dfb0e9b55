"""Env ``verifiers`` and rollout ``verifiers``: episodes of a verifiers environment.

Only the registration hooks live here; the worker client in ``client``, the env in ``env``, the
rollout in ``rollout``, the policy folder for ``miles serve`` in ``policy``. The verifiers side
(a taskset, a harness and an HTTP worker) lives in ``../worker`` and runs in its own virtualenv.
"""
from miles import hookimpl


@hookimpl
def miles_register_envs(register):
    from .config import VerifiersConfig

    register("verifiers", _make_env, config=VerifiersConfig)


@hookimpl
def miles_register_rollouts(register):
    from .config import VerifiersRolloutConfig

    register("verifiers", _make_rollout, config=VerifiersRolloutConfig)


def _make_env(cfg, **_):
    from .env import VerifiersEnv

    return VerifiersEnv(cfg)


def _make_rollout(cfg, **_):
    from .rollout import VerifiersRollout

    return VerifiersRollout(cfg)
