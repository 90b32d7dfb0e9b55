"""The mlflow logger, read back with ``MlflowClient`` from its default local SQLite store."""
import math
from pathlib import Path

import pytest
import yaml
from miles import MilesError, make_plugin_manager
from mlflow.tracking import MlflowClient

CONFIG = {"model": {"name": "hf", "config": {"hidden_size": 32}}, "run": {"steps": 3}, "env": {"a:b@c": "x"},
          "loggers": ["console", {"name": "mlflow"}]}


def test_metrics_config_and_resume_in_the_sqlite_store(tmp_path):
    pm = make_plugin_manager()
    cfg = pm.registry("loggers")["mlflow"].config(experiment="tiny")
    lg = pm.create("loggers", "mlflow", cfg, out_dir=str(tmp_path), total_steps=3, config=CONFIG)
    for step in range(3):
        lg.log(step, {"reward_mean": step / 4, "weight_sync_bytes": 2**40 + step, "skipped": step == 1,
                      "loss": float("nan") if step == 2 else 0.5, "note": "not a metric"})
    lg.close()
    # the same run folder again (a resume): the same MLflow run goes on
    again = pm.create("loggers", "mlflow", cfg, out_dir=str(tmp_path), total_steps=3, config=CONFIG)
    again.log(3, {"reward_mean": 0.75})
    again.close()
    assert again.run_id == lg.run_id

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(lg.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert client.get_experiment(run.info.experiment_id).name == "tiny"
    history = {k: [(m.step, m.value) for m in client.get_metric_history(lg.run_id, k)]
               for k in ("reward_mean", "weight_sync_bytes", "skipped", "loss")}
    assert history["reward_mean"] == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75)]
    assert history["weight_sync_bytes"] == [(s, float(2**40 + s)) for s in range(3)]
    assert history["skipped"] == [(0, 0.0), (1, 1.0), (2, 0.0)]
    assert math.isnan(history["loss"][2][1])
    assert set(run.data.metrics) == {"reward_mean", "weight_sync_bytes", "skipped", "loss"}
    assert run.data.params["model.config.hidden_size"] == "32" and run.data.params["run.steps"] == "3"
    assert run.data.params["env.a_b_c"] == "x"  # a character MLflow refuses in names becomes _
    # the whole config, unflattened, as an artifact in the run folder (not the working directory)
    local = client.download_artifacts(lg.run_id, "config.yaml", str(tmp_path / "dl"))
    assert yaml.safe_load(Path(local).read_text()) == CONFIG
    assert run.info.artifact_uri.startswith((tmp_path / "mlflow-artifacts").as_uri())


def test_unreachable_store_names_the_setting(tmp_path):
    from miles_plugin_mlflow.config import MlflowConfig
    from miles_plugin_mlflow.logger import MlflowLogger

    with pytest.raises(MilesError, match="tracking_uri"):
        MlflowLogger(MlflowConfig(tracking_uri="sqlite:////proc/no-such-dir/mlflow.db"), out_dir=str(tmp_path))


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """A killed run logged steps 0-4 (not closed: killed); the rerun resumes after its step-2
    checkpoint and logs 3-6 again: MLflow holds one point per metric and step."""
    from miles_plugin_mlflow.logger import MlflowLogger

    killed = MlflowLogger(out_dir=str(tmp_path), config=CONFIG)
    for step in range(5):
        killed.log(step, {"reward_mean": float(step), **({"eval_accuracy": 0.5} if step in (0, 4) else {})})
    rerun = MlflowLogger(out_dir=str(tmp_path), config=CONFIG)
    assert rerun.run_id == killed.run_id
    for step in range(3, 7):
        rerun.log(step, {"reward_mean": 10.0 + step, "loss": 1.0,
                         **({"eval_accuracy": 0.75} if step in (4, 6) else {})})
    rerun.close()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    history = {k: [(m.step, m.value) for m in client.get_metric_history(killed.run_id, k)]
               for k in ("reward_mean", "eval_accuracy", "loss")}
    # steps the store held keep their values; only the pairs it did not hold are added
    assert sorted(history["reward_mean"]) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0),
                                              (5, 15.0), (6, 16.0)]
    assert sorted(history["eval_accuracy"]) == [(0, 0.5), (4, 0.5), (6, 0.75)]
    assert sorted(history["loss"]) == [(s, 1.0) for s in range(3, 7)]


def test_earlier_steps_the_store_lacks_come_from_metrics_jsonl(tmp_path):
    """A run resumed at step 3 whose MLflow store was replaced: steps 0-2 come from metrics.jsonl."""
    import json

    from miles_plugin_mlflow.logger import MlflowLogger

    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward_mean": s / 4, "text": "x"}) + "\n" for s in range(3)))
    lg = MlflowLogger(out_dir=str(tmp_path), config=CONFIG)
    lg.log(3, {"reward_mean": 0.75})
    lg.log(4, {"reward_mean": 1.0})
    lg.close()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    got = sorted((m.step, m.value) for m in client.get_metric_history(lg.run_id, "reward_mean"))
    assert got == [(s, s / 4) for s in range(5)]
