"""The task order of RL steps (``miles.taskorder``): random samples by default; epochs for an env
that trains in epochs (each a seeded permutation, consecutive slices, resumable from a count)."""
import random
from collections import Counter
from types import SimpleNamespace

import pytest
from miles import EngineRestarted, Task
from miles.config import RolloutConfig
from miles.modes import SyncMode
from miles.protocols import TrainsInEpochs
from miles.rollouts import ModeContext
from miles.taskorder import TaskOrder
from miles.testing import make_group

TASKS = [Task(prompt=f"p{i}", label=str(i), id=f"t{i}") for i in range(10)]


def ids(tasks):
    return [t.id for t in tasks]


def steps(order, batch, count):
    return [ids(order.draw(random.Random(0), batch)) for _ in range(count)]


def test_each_epoch_is_a_seeded_permutation_of_every_task():
    order = TaskOrder(TASKS, seed=3, epochs=True)
    epochs = [order.permutation(e) for e in range(4)]
    assert all(sorted(p) == list(range(10)) for p in epochs)
    assert len({tuple(p) for p in epochs}) == 4  # a new order every epoch
    assert epochs == [TaskOrder(TASKS, seed=3, epochs=True).permutation(e) for e in range(4)]  # same seed, same
    assert epochs[0] != TaskOrder(TASKS, seed=4, epochs=True).permutation(0)
    assert TaskOrder(TASKS, seed=3, epochs=True, shuffle=False).permutation(5) == list(range(10))


def test_steps_take_consecutive_slices_and_run_on_into_the_next_epoch():
    order = TaskOrder(TASKS, seed=1, epochs=True)
    drawn = [t for s in steps(order, 4, 5) for t in s]  # 20 tasks: two epochs, 4 does not divide 10
    first, second = drawn[:10], drawn[10:]
    assert first == [f"t{i}" for i in order.permutation(0)] and second == [f"t{i}" for i in order.permutation(1)]
    assert Counter(first) == Counter(second) == Counter(ids(TASKS))  # every task exactly once an epoch
    assert order.consumed == 20 and order.metrics() == {"epoch": 2.0}
    assert steps(order, 25, 1)[0] == [f"t{i}" for i in order.permutation(2)]  # a batch over the split: one epoch


def test_a_resumed_order_continues_where_the_uninterrupted_one_would_be():
    whole = TaskOrder(TASKS, seed=7, epochs=True)
    uninterrupted = steps(whole, 3, 9)
    first = TaskOrder(TASKS, seed=7, epochs=True)
    steps(first, 3, 4)
    resumed = TaskOrder(TASKS, seed=7, epochs=True)
    resumed.consumed = first.consumed  # what the checkpoint keeps
    assert steps(resumed, 3, 5) == uninterrupted[4:]


def test_without_epochs_it_samples_with_the_steps_rng_as_before():
    order = TaskOrder(TASKS, seed=0)
    assert ids(order.draw(random.Random(5), 4)) == ids(random.Random(5).sample(TASKS, 4))
    assert len(order.draw(random.Random(5), 50)) == 10 and order.metrics() == {} and order.consumed == 0


def test_an_env_asks_for_epochs_through_the_protocol():
    plain = SimpleNamespace(tasks=lambda split: TASKS, reward=lambda s: 0.0)
    epochs = SimpleNamespace(tasks=lambda split: TASKS, reward=lambda s: 0.0, shuffle_epochs=False)
    assert isinstance(epochs, TrainsInEpochs) and not isinstance(plain, TrainsInEpochs)
    assert not TaskOrder.for_env(plain, 0).epochs
    order = TaskOrder.for_env(epochs, 0)
    assert order.epochs and not order.shuffle and ids(order.draw(random.Random(0), 3)) == ["t0", "t1", "t2"]


def _mode(order, run, **rollout):
    rollouts = SimpleNamespace(run=run, keep=lambda g: any(s.reward for s in g.samples), metrics=lambda s: {})
    return SyncMode(ctx=ModeContext(None, RolloutConfig(**rollout), rollouts, None, [], order.tasks, None, 0,
                                    True, False, order=order))


def test_sync_refill_rounds_draw_on_and_a_retried_take_redraws_the_same_slice():
    order, seen, fail = TaskOrder(TASKS, seed=2, epochs=True), [], [True]

    def run(tasks, n, params):
        if fail[0]:
            fail[0] = False
            raise EngineRestarted("engine 0 restarted")
        seen.append(ids(tasks))
        return [make_group([float(t.id in ("t1", "t2", "t3")), 0.0], task=t) for t in tasks]

    mode = _mode(order, run, batch_size=4, n=2, oversample_rounds=2)
    with pytest.raises(EngineRestarted):
        mode.take(random.Random(0), None)
    assert order.consumed == 0  # the loop asks again after re-syncing: nothing was skipped
    kept, m = mode.take(random.Random(0), None)
    perm = [f"t{i}" for e in (0, 1) for i in order.permutation(e)]
    drawn = [t for s in seen for t in s]
    assert len(seen) == 3 and drawn == perm[:len(drawn)]  # only 3 tasks are kept: two refills continue the slice
    assert order.consumed == len(drawn)
    assert m["epoch"] == len(drawn) / 10 and m["groups_kept"] == len(kept)
