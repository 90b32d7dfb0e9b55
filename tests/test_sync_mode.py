"""Run mode ``sync``: registered lazily, follows the kernel's ``Mode`` protocol, refills a batch
whose groups were filtered out for a bounded number of rounds."""
import random
from types import SimpleNamespace

from miles import SamplingParams
from miles.config import RolloutConfig
from miles.protocols import Mode
from miles.rollouts import ModeContext
from miles.testing import assert_lazy_registration, make_group
from miles.modes import SyncMode


def _ctx(rollouts, **rollout):
    tasks = [make_group([0.0]).task for _ in range(16)]
    transport = SimpleNamespace(sync=lambda source, engines, version: {"weight_sync_seconds": float(version)})
    return ModeContext(None, RolloutConfig(**rollout), rollouts, transport, [], tasks, SamplingParams(), 0,
                       True, False)


def test_registration_is_lazy():
    assert_lazy_registration("miles.builtin", "modes", "sync")


def test_it_is_a_mode_and_pushes_through_the_transport():
    mode = SyncMode(ctx=_ctx(None))
    assert isinstance(mode, Mode)
    assert mode.push(object(), [], 3) == {"weight_sync_seconds": 3.0}
    assert mode.finish_push() == {} and mode.reweight("batch", None) == ("batch", {})
    with mode.lock_engines():
        mode.close()


def test_filtered_groups_are_refilled_for_at_most_oversample_rounds():
    calls = []

    def run(tasks, n, params):
        calls.append(len(tasks))
        return [make_group([float(len(calls) == 3), 0.0], task=t) for t in tasks]  # only round 3 has signal

    rollouts = SimpleNamespace(run=run, keep=lambda g: any(s.reward for s in g.samples), metrics=lambda s: {})
    kept, m = SyncMode(ctx=_ctx(rollouts, batch_size=4, n=2, oversample_rounds=1)).take(random.Random(0), None)
    assert calls == [4, 4] and kept == [] and m["groups_dropped"] == 8  # two rounds, then the step goes on
    calls.clear()
    kept, m = SyncMode(ctx=_ctx(rollouts, batch_size=4, n=2, oversample_rounds=5)).take(random.Random(0), None)
    assert calls == [4, 4, 4] and len(kept) == 4 and m["groups_kept"] == 4 and m["reward_mean"] == 4 / 24
