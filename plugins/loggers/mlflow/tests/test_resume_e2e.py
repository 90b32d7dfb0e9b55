"""A real ``miles train`` killed (``os._exit``) right after its last step (3) was logged, before its
checkpoint, then rerun: it resumes at the step-2 checkpoint and logs step 3 again. MLflow, W&B (offline) and
TensorBoard each end with one point per metric and step, read back with their own readers."""
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
KILL = '''
import os
from miles import hookimpl


@hookimpl
def miles_on_step_end(step, metrics):
    if os.environ.get("KILL_AFTER_STEP") == str(step):
        os._exit(137)  # as a kill -9 would: no logger is closed, no checkpoint written
'''
LOGGERS = "loggers=[{name: mlflow}, {name: wandb}, {name: tensorboard}]"


def train(out: Path, plugin: Path, kill_after: int | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("KILL_AFTER_STEP", None)
    if kill_after is not None:
        env["KILL_AFTER_STEP"] = str(kill_after)
    cmd = [sys.executable, "-m", "miles.cli", "train", str(ROOT / "tests" / "tiny.yaml"), "--plugin", str(plugin),
           f"run.out_dir={out}", "run.steps=3", "run.checkpoint_every=2", "run.eval_every=3",
           "run.warm_start=null", "rollout.batch_size=4", "rollout.n=2", "env.eval_size=4", LOGGERS]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_killed_and_resumed_run_has_one_point_per_step_in_every_logger(tmp_path):
    from miles_plugin_wandb.offline import read_offline_run
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plugin, out = tmp_path / "kill.py", tmp_path / "run"
    plugin.write_text(KILL)
    killed = train(out, plugin, kill_after=3)
    assert killed.returncode == 137, killed.stderr[-3000:]
    rerun = train(out, plugin, kill_after=None)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    keys = {k for r in rows for k, v in r.items() if k != "step" and (v is None or isinstance(v, (int, float)))}
    assert {"reward_mean", "eval_accuracy"} <= keys

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    run_id = (out / "mlflow_run_id").read_text().strip()
    assert client.get_run(run_id).info.status == "FINISHED"
    for key in keys:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        want = [r["step"] for r in rows if key in r]
        assert sorted(steps) == want, (key, steps)  # one point per step: step 3 not twice

    segments = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(segments) == 2
    logged = Counter(s for seg in segments for s in read_offline_run(seg)["history"])
    assert sorted(logged) == [0, 1, 2, 3] and set(logged.values()) == {1}, logged

    ea = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    for key in ("reward_mean", "eval_accuracy"):
        assert [e.step for e in ea.Scalars(key)] == [r["step"] for r in rows if key in r], key
