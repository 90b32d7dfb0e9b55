"""run.mode async: the pacing of the rollout workers and the importance weights of stale samples
(no engine: a stand-in loop with just what ``miles_plugin_async`` reads)."""
import math

import pytest
import torch
from miles import Sample, Task
from miles.modes import SyncMode
from miles.config import RolloutConfig
from miles.rollouts import ModeContext
from miles.types import Batch, SamplingParams
from miles_plugin_async.config import AsyncConfig
from miles_plugin_async.mode import reweight
from miles_plugin_async.streamer import EXTRA, MARGIN, Streamer


def context(version=0, rollouts=None, transport=None, **rollout):
    return ModeContext(None, RolloutConfig(**rollout), rollouts, transport, [], [], SamplingParams(), 0, True,
                       False, version_fn=lambda: version)


def streamer(version=5, engine_version=5, **settings):
    s = Streamer(AsyncConfig(**settings), context(version, batch_size=64), None)  # threads made, not started
    s.engine_version = engine_version
    return s


def test_pacing_fills_one_step_ahead_on_the_newest_weights():
    s = streamer(version=5, engine_version=5)
    s.per_kept, s.taken_at = 2.0, 5  # the trainer took its groups at version 5 and trains
    per_step = 64 * 2.0 * (1 + MARGIN)  # what the next take (at version 6) will take
    assert s._chunk_size() == 64  # a whole batch of prompts per request at most
    s.in_flight = int(per_step) - 20
    assert s._chunk_size() == 20  # what is left of the room
    s.in_flight = int(per_step) - 10
    assert s._chunk_size() == 0  # less than a quarter of a request: wait


def test_pacing_generates_nothing_that_would_be_dropped_as_stale():
    # the trainer bumped to version 6; the push of 6 has not landed (the engines have 5)
    s = streamer(version=6, engine_version=5)
    s.per_kept, s.taken_at = 2.0, 5
    s.in_flight = 140  # the next take's groups (version-5 weights, one version old when taken)
    assert s._chunk_size() == 0
    s.taking, s.need, s.in_flight = True, 10, 0  # that take is on, its groups in the buffer
    for _ in range(30):
        s.buffer.put_nowait(object())
    assert s._chunk_size() == 0  # more would be taken at version 7: two versions old
    s.wake(landed=6)
    assert s._chunk_size() == 0  # not before this take is done: it would hold the engines up
    s.taking, s.taken_at = False, 6
    assert s._chunk_size() == 64  # version-6 groups for the next take


def test_a_take_that_runs_short_gets_what_it_lacks_at_once():
    s = streamer(version=6, engine_version=5)  # its push has not landed: one version old is fine
    s.per_kept, s.taking, s.need = 2.0, True, 8
    s.buffer.put_nowait(object())
    lack = math.ceil(8 * 2.0 * (1 + MARGIN)) - 1
    assert s._chunk_size() == lack + EXTRA
    s.in_flight = lack
    assert s._chunk_size() == 0  # coming
    s.in_flight, s.need = 0, 1
    assert s._chunk_size() == math.ceil(2.0 * (1 + MARGIN)) - 1 + EXTRA  # a few more than it expects to need


def test_with_max_staleness_zero_a_take_waits_for_the_new_weights():
    s = streamer(version=6, engine_version=5, max_staleness=0)
    s.per_kept, s.taking, s.need = 2.0, True, 8
    assert s._chunk_size() == 0  # these would be dropped as stale
    s.wake(landed=6)
    assert s._chunk_size() == math.ceil(8 * 2.0 * (1 + MARGIN)) + EXTRA


def test_pacing_with_max_staleness_zero_waits_between_takes():
    s = streamer(version=5, engine_version=5, max_staleness=0)
    s.per_kept, s.taken_at = 1.0, 5
    assert s._chunk_size() == 0  # anything generated now is taken at version 6


def batch(versions, rollout_lp=-1.0):
    task = Task(prompt="p", label="l")
    samples = [Sample(task=task, prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[rollout_lp] * 2,
                      weight_version=v) for v in versions]
    return Batch.from_samples(samples, 0, [1.0] * len(samples))




def test_stale_samples_get_truncated_importance_weights_from_the_trained_logprobs():
    b = batch([4, 5, 3])
    lp = torch.tensor([[-0.5, -1.0], [-0.5, -0.5], [-1.2, 2.0]], requires_grad=True)
    out, m = reweight(AsyncConfig(), 5, b, lp)
    w = torch.exp(lp.detach() + 1.0).clamp(max=2.0)
    assert torch.allclose(out.advantages[0], w[0]) and torch.allclose(out.advantages[2], w[2])
    assert torch.equal(out.advantages[1], b.advantages[1])  # on-policy: untouched
    assert out.advantages[2, 1] == 2.0  # truncated at rollout.importance_cap
    assert m["importance_weight_mean"] == pytest.approx(float((w[0].sum() + w[2].sum()) / 4))
    assert torch.equal(b.advantages, torch.ones(3, 2))  # the trainer's batch is not changed


def test_old_logprobs_are_the_proximal_policy_when_there_are_several_optimizer_steps():
    b = batch([4])
    b.old_logprobs = torch.tensor([[-1.5, -0.5]])
    out, _ = reweight(AsyncConfig(), 5, b, torch.zeros(1, 2))
    assert torch.allclose(out.advantages, torch.exp(b.old_logprobs + 1.0))


def test_without_correct_stale_only_groups_kept_past_max_staleness_are_weighted():
    b, lp = batch([4, 3]), torch.zeros(2, 2)
    out, m = reweight(AsyncConfig(correct_stale=False), 5, b, lp)
    assert out is b and m == {}  # stale_policy drop: nothing older than max_staleness is kept
    out, _ = reweight(AsyncConfig(correct_stale=False, stale_policy="importance"), 5, b, lp)
    assert torch.equal(out.advantages[0], torch.ones(2)) and torch.equal(out.advantages[1], torch.full((2,), 2.0))


def test_sync_runs_are_never_reweighted():
    b = batch([3])
    assert SyncMode(ctx=context(5)).reweight(b, torch.zeros(1, 2)) == (b, {})
