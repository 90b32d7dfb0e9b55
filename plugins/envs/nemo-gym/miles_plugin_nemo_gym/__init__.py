"""Env ``nemo-gym`` and rollout ``nemo-gym``: training on NeMo Gym agent servers.

Only the registration hooks live here: the rows in ``env``, the ``/run`` client in ``client``,
the trajectory-to-tokens conversion in ``trajectory``, the rollout in ``rollout``, starting and
stopping NeMo Gym's servers in ``launch``. NeMo Gym's own servers (the ``miles_arith`` resources
server, the ``miles_model`` model server) are under ``gym/`` and run in NeMo Gym's venv.
"""
from miles import hookimpl


@hookimpl
def miles_register_envs(register):
    from .config import NemoGymConfig

    register("nemo-gym", _make_env, config=NemoGymConfig)


@hookimpl
def miles_register_rollouts(register):
    from .config import NemoGymRolloutConfig

    register("nemo-gym", _make_rollout, config=NemoGymRolloutConfig)


def _make_env(cfg, **_):
    from .env import NemoGymEnv

    return NemoGymEnv(cfg)


def _make_rollout(cfg, **_):
    from .rollout import NemoGymRollout

    return NemoGymRollout(cfg)
