"""True on-policy (rollout.true_on_policy): the engine's log-probs of the sampled tokens equal the
trainer's bit for bit, so train_rollout_logprob_abs_diff is exactly 0.0 and the PPO ratio is
exactly 1 on the first mini-batch of every step."""
import json
from pathlib import Path

import pytest
from miles.cli import main

ROOT = Path(__file__).resolve().parents[1]

# records, for every rollout mini-batch the trainer steps on, how far the trainer's log-probs are
# from the rollout's and from the old policy's (returns None: the algorithm's loss is used)
RECORDER = '''
import json, os
from miles import hookimpl

@hookimpl
def miles_reward(sample):  # varies within groups, so every step really moves the policy
    return float(sample.response_ids[0] % 2) if sample.response_ids else 0.0

@hookimpl
def miles_loss(batch, logprobs):
    if not batch.samples[0].logprobs:  # a warm-start (demonstration) batch
        return None
    m = batch.loss_mask > 0
    lp = logprobs.detach()
    row = {"rollout": float((lp - batch.rollout_logprobs).abs()[m].max()),
           "old": None if batch.old_logprobs is None else float((lp - batch.old_logprobs).abs()[m].max())}
    with open(os.environ["MILES_TEST_RECORD"], "a") as f:
        f.write(json.dumps(row) + "\\n")
'''


def tiny_run(tmp_path, monkeypatch, *overrides):
    plugin = tmp_path / "recorder.py"
    plugin.write_text(RECORDER)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("MILES_TEST_RECORD", str(record))
    out = tmp_path / "run"
    rc = main(["train", str(ROOT / "tests/tiny.yaml"), "--plugin", str(plugin), f"run.out_dir={out}",
               "run.steps=3", "run.eval_every=3", "run.checkpoint_every=3", "loggers=[]",
               "algorithm.filter_zero_variance=false", "rollout.batch_size=6", *overrides])
    assert rc == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [m for m in metrics if m["step"] > 0], [json.loads(x) for x in record.read_text().splitlines()]


def test_true_on_policy_is_bitwise(tmp_path, monkeypatch):
    steps, record = tiny_run(tmp_path, monkeypatch, "rollout.true_on_policy=true", "rollout.minibatches=2")
    assert len(steps) == 3 and len(record) == 6  # 3 steps x 2 mini-batches
    first, second = record[0::2], record[1::2]
    # first mini-batch: the engine's log-probs are the trainer's, bit for bit; ratio exactly 1
    assert all(r["rollout"] == 0.0 and r["old"] == 0.0 for r in first)
    # second: the trainer has stepped once, the engine still holds the step's old weights, whose
    # log-probs are the PPO ratio's reference (so the first step really moved the policy)
    assert all(r["rollout"] > 0 and r["rollout"] == r["old"] for r in second)


def test_metric_is_exactly_zero_with_one_minibatch(tmp_path, monkeypatch):
    steps, record = tiny_run(tmp_path, monkeypatch, "rollout.true_on_policy=true")
    assert [m["train_rollout_logprob_abs_diff"] for m in steps] == [0.0, 0.0, 0.0]
    assert all(m["ppo_kl"] == 0.0 and m["pg_clipfrac"] == 0.0 for m in steps)
    assert all(r["rollout"] == 0.0 for r in record)


def test_without_the_mode_the_difference_is_tiny_but_not_zero(tmp_path, monkeypatch):
    steps, _ = tiny_run(tmp_path, monkeypatch)
    diffs = [m["train_rollout_logprob_abs_diff"] for m in steps]
    # the sampler's KV-cached decode and the trainer's one-pass forward round differently
    assert all(0 < d < 1e-5 for d in diffs), diffs


def test_true_on_policy_needs_sync_mode():
    from miles import ConfigError, make_plugin_manager
    from miles.config import resolve

    with pytest.raises(ConfigError, match="rollout.true_on_policy: needs run.mode sync"):
        resolve(make_plugin_manager(), {"rollout": {"true_on_policy": True}, "run": {"mode": "async"}})


@pytest.mark.gpu
def test_true_on_policy_on_the_gpu(tmp_path, monkeypatch):
    """Trainer and engine on CUDA (float32): the mode still gives bit-identical log-probs (the
    same kernels on the same batch shapes); without it the difference is printed for the record."""
    runs = {}
    for name, extra in (("on", ["rollout.true_on_policy=true"]), ("off", [])):
        (tmp_path / name).mkdir()
        steps, _ = tiny_run(tmp_path / name, monkeypatch, "trainer.device=cuda", "engine.device=cuda", *extra)
        runs[name] = [m["train_rollout_logprob_abs_diff"] for m in steps]
    print(f"\nGPU float32 train_rollout_logprob_abs_diff: with the mode {runs['on']}, without {runs['off']}")
    assert runs["on"] == [0.0, 0.0, 0.0] and all(d > 0 for d in runs["off"])
