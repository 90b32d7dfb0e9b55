"""A few miles training steps on the verifiers worker's episodes, the policy in `miles serve`
(recipes/verifiers.yaml, shortened): rewards arrive, the policy's tokens train as generated, and
every step's weights reach the server before the next rollout."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.slow
def test_training_steps_on_verifiers_episodes(worker_url, policy_url, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles.cli", "train", str(ROOT / "recipes/verifiers.yaml"),
           f"env.worker_url={worker_url}", f"env.policy_url={policy_url}", f"engine.urls=[{policy_url}]",
           "env.train_size=16", "env.eval_size=4", "rollout.batch_size=4", "run.steps=3", "run.eval_every=3",
           "run.checkpoint_every=100", f"run.out_dir={out}",
           # an untrained model rarely adds right: keep all-zero groups so every step trains
           "algorithm.filter_zero_variance=false"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in steps[-1]
    for r in steps:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r.get("env_failed", 0.0) == 0.0, r
        # the trainer re-scores the policy's own token ids: its log-probs match the server's
        assert r["train_rollout_logprob_abs_diff"] < 1e-3, r
        # each step's rollout ran on the weights the previous step pushed to miles serve
        assert r["weight_version"] == r["step"] and r["staleness_mean"] == 0.0, r
