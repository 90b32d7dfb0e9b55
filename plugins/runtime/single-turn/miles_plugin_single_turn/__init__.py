"""miles plugin: rollout ``single_turn``, the default ``rollout.name``: one generation per sample,
every task of a step in one batched engine call; and the ``trylast`` ``miles_rollout`` default,
the same generation for one task.

Only hooks live here; the rollout is in ``rollout``.
"""
from miles import hookimpl


@hookimpl
def miles_register_rollouts(register):
    register("single_turn", _make)


def _make(cfg=None, **_):
    from .rollout import SingleTurn

    return SingleTurn(cfg)


@hookimpl(trylast=True)
def miles_rollout(task, n, engine, tokenizer, params):
    """Default: one single-turn generation of ``n`` samples, for callers outside a run (a run sends
    the tasks no other hook claims to its ``rollout.name`` component, batched, instead)."""
    from .rollout import single_turn

    return single_turn([task], n, engine, tokenizer, params)[0]
