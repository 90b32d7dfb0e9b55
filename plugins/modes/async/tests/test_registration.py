"""The plugin registers run mode ``async`` without importing torch, and it satisfies the
kernel's ``Mode`` protocol like ``sync`` (miles-plugin-sync)."""
from types import SimpleNamespace

from miles import SamplingParams
from miles.modes import SyncMode
from miles.config import RolloutConfig
from miles.protocols import Mode
from miles.rollouts import ModeContext
from miles.testing import assert_lazy_registration
from miles_plugin_async.config import AsyncConfig
from miles_plugin_async.mode import AsyncMode


def test_registration_is_lazy():
    assert_lazy_registration("miles_plugin_async", "modes", "async")


def test_both_modes_follow_the_protocol():
    ctx = ModeContext(None, RolloutConfig(), None, None, [], [], SamplingParams(), 0, True, False)
    for mode in (SyncMode(ctx=ctx), AsyncMode(AsyncConfig(), ctx)):
        assert isinstance(mode, Mode)
        assert mode.finish_push() == {}  # nothing pending
        mode.close()


def test_a_restarted_engine_is_pushed_the_weights_again_and_the_workers_go_on():
    """A worker's ``EngineRestarted`` reaches the trainer's ``take``; the loop then pushes the
    current weights (``wait=True``), which lets the workers redo their chunk."""
    import pytest
    from miles import EngineRestarted
    from miles.testing import make_group

    calls = {"rollout": 0, "push": 0}

    def rollout(tasks, n, params):
        calls["rollout"] += 1
        if calls["rollout"] == 1:
            raise EngineRestarted("engine 0 restarted without the current weights")
        return [make_group([0.0, 1.0], task=t) for t in tasks]

    def sync(trainer, engines, version):
        calls["push"] += 1
        return {"weight_sync_seconds": 0.0}

    service = SimpleNamespace(run=rollout, keep=lambda g: True, metrics=lambda samples: {})
    ctx = ModeContext(None, RolloutConfig(batch_size=2, n=2), service, SimpleNamespace(sync=sync), [],
                      [make_group([0.0]).task for _ in range(8)], SamplingParams(), 0, True, False)
    mode = AsyncMode(AsyncConfig(async_workers=1), ctx)
    try:
        with pytest.raises(EngineRestarted):
            mode.take(None, None)
        assert mode.push(object(), [], 0, wait=True) == {"weight_sync_seconds": 0.0}
        kept, m = mode.take(None, None)
        assert len(kept) == 2 and m["groups_kept"] == 2
        assert calls["push"] == 1 and calls["rollout"] >= 2  # the failed chunk, then again
    finally:
        mode.close()
