"""Rollout ``multi_turn``: tool-using trajectories as one token sequence per sample.

Only the registration hook lives here; the loop is in ``rollout``, tool-call formats in
``parsing``, how tool output becomes tokens in ``framing``.
"""
from miles import hookimpl


@hookimpl
def miles_register_rollouts(register):
    from .config import MultiTurnConfig

    register("multi-turn", _make, config=MultiTurnConfig)


def _make(cfg, **_):
    from .rollout import MultiTurnRollout

    return MultiTurnRollout(cfg)
