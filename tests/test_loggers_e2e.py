"""One real ``miles train`` run with the tensorboard, wandb and mlflow loggers: each holds every
numeric metric of every step of metrics.jsonl and the run's config, read back with each library's
own reader; then ``miles report`` of that run folder."""
import json
import math

import pytest

from .conftest import ROOT, run_cli

LOGGERS = "loggers=[console, {name: tensorboard}, {name: wandb, run_name: e2e}, {name: mlflow, experiment: e2e}]"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("loggers") / "run"
    r = run_cli("train", str(ROOT / "tests" / "tiny.yaml"), f"run.out_dir={out}", "run.steps=2", "run.eval_every=1",
                "run.warm_start=null", LOGGERS, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def numeric_rows(run_dir):
    """{step: {metric: value}} of metrics.jsonl, where None stands for a NaN/inf the loggers got as is."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    return {r["step"]: {k: math.nan if v is None else v for k, v in r.items()
                        if k != "step" and (v is None or isinstance(v, (int, float)))} for r in rows}


def same(got, want):
    """Equal series {step: value}; a NaN/inf logged value matches a None in metrics.jsonl."""
    return got.keys() == want.keys() and all(
        (math.isnan(want[s]) and not math.isfinite(got[s])) or math.isclose(got[s], want[s], rel_tol=1e-6)
        for s in want)


@pytest.mark.slow
def test_every_logger_holds_every_metric_and_the_config(run_dir):
    from miles_plugin_wandb.offline import read_offline_run
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = numeric_rows(run_dir)
    keys = {k for row in expected.values() for k in row}
    assert {"reward_mean", "eval_accuracy", "rollout_seconds", "step_seconds"} <= keys

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    assert set(ea.Tags()["scalars"]) == keys
    for key in keys:
        got = {e.step: e.value for e in ea.Scalars(key)}
        assert same(got, {s: row[key] for s, row in expected.items() if key in row}), key
    assert "steps: 2" in ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()

    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    wb = read_offline_run(wandb_file)
    assert wb["name"] == "e2e" and wb["config"]["run"]["steps"] == 2
    assert wb["history"].keys() == expected.keys()
    for key in keys:
        got = {s: row[key] for s, row in wb["history"].items() if key in row}
        assert same(got, {s: row[key] for s, row in expected.items() if key in row}), key

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["run.steps"] == "2"
    assert set(run.data.metrics) == keys
    for key in keys:
        got = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert same(got, {s: row[key] for s, row in expected.items() if key in row}), key


@pytest.mark.slow
def test_miles_report_of_the_run(run_dir):
    r = run_cli("report", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    page = run_dir / "report" / "index.html"
    assert str(page) in r.stdout
    text = page.read_text()
    for fig in ("fig-reward", "fig-timings", "fig-other"):
        assert f'id="{fig}"' in text
    assert (run_dir / "report" / "reward.png").stat().st_size > 5000
    bad = run_cli("report", str(run_dir / "nope"))
    assert bad.returncode == 2 and "is not a folder" in bad.stderr and "Traceback" not in bad.stderr


def test_listing_plugins_imports_no_logger_library():
    """wandb, mlflow, tensorboard and matplotlib load only when a run uses them: miles plugins stays fast."""
    import subprocess
    import sys

    code = ("import sys; from miles import make_plugin_manager; pm = make_plugin_manager(); "
            "assert {'tensorboard', 'wandb', 'mlflow', 'report'} <= set(pm.registry('loggers')); "
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard', 'matplotlib') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
