"""The wandb logger in offline mode (no network, no account), read back from the run's ``.wandb``
transaction log with wandb's own protobuf records."""
import math

from miles import make_plugin_manager
from miles_plugin_wandb.offline import read_offline_run

CONFIG = {"model": {"name": "hf"}, "run": {"steps": 3}, "loggers": [{"name": "wandb"}]}


def test_offline_run_holds_every_metric_of_every_step_and_the_config(tmp_path):
    pm = make_plugin_manager()
    cfg = pm.registry("loggers")["wandb"].config(run_name="tiny-run")
    lg = pm.create("loggers", "wandb", cfg, out_dir=str(tmp_path), total_steps=3, config=CONFIG)
    for step in range(4):
        lg.log(step, {"reward_mean": step / 4, "weight_version": step, "loss": float("nan") if step == 2 else 0.5})
    lg.close()
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    run = read_offline_run(files[0])
    assert run["name"] == "tiny-run" and run["project"] == "miles"
    assert run["config"] == CONFIG
    history = run["history"]
    assert sorted(history) == [0, 1, 2, 3]
    assert [history[s]["reward_mean"] for s in range(4)] == [0, 0.25, 0.5, 0.75]
    assert [history[s]["weight_version"] for s in range(4)] == [0, 1, 2, 3]
    assert math.isnan(history[2]["loss"]) and history[3]["loss"] == 0.5


def test_rerun_continues_the_same_wandb_run(tmp_path):
    from miles_plugin_wandb.logger import WandbLogger

    (tmp_path / "config.yaml").write_text("env:\n  name: arith\n")
    for steps in (range(3), range(2, 5)):  # the second attempt resumes after step 1
        lg = WandbLogger(out_dir=str(tmp_path))
        for step in steps:
            lg.log(step, {"reward_mean": float(step)})
        lg.close()
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.name for f in files}) == 1  # one run id, two offline segments
    first, second = (read_offline_run(f) for f in files)
    # step 2 is in the first segment already: the rerun starts after it (one row per step)
    assert sorted(first["history"]) == [0, 1, 2] and sorted(second["history"]) == [3, 4]
    assert second["config"] == {"env": {"name": "arith"}}


def test_last_offline_step_reads_a_cut_off_segment(tmp_path):
    """A segment a killed process left cut off mid-record still tells the steps it holds."""
    from miles_plugin_wandb.logger import WandbLogger
    from miles_plugin_wandb.offline import last_offline_step

    lg = WandbLogger(out_dir=str(tmp_path))
    for step in range(4):
        lg.log(step, {"reward_mean": float(step), "pad": "x" * 3000})
    lg.close()
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert last_offline_step(tmp_path / "wandb", run_id) == 3
    assert last_offline_step(tmp_path / "wandb", "other") == -1
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    cut = data.rindex(b"reward_mean")  # inside the last history record
    path.write_bytes(data[:cut])
    assert last_offline_step(tmp_path / "wandb", run_id) == 2


def test_reader_refuses_other_files(tmp_path):
    import pytest

    (tmp_path / "x.wandb").write_bytes(b"not a log")
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        read_offline_run(tmp_path / "x.wandb")


def test_steps_a_killed_offline_run_lost_come_back_from_metrics_jsonl(tmp_path):
    """An offline run killed before wandb wrote its records leaves an empty segment; the rerun
    logs the run folder's earlier steps first, so the W&B run misses none."""
    import json

    from miles_plugin_wandb.logger import WandbLogger

    (tmp_path / "wandb_run_id").write_text("abc123def456")
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward_mean": s / 4, "eval_accuracy": None}) + "\n" for s in range(3)))
    lg = WandbLogger(out_dir=str(tmp_path))
    for step in (3, 4):
        lg.log(step, {"reward_mean": step / 4})
    lg.close()
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-abc123def456.wandb")
    history = read_offline_run(path)["history"]
    assert sorted(history) == [0, 1, 2, 3, 4]
    assert [history[s]["reward_mean"] for s in range(5)] == [0, 0.25, 0.5, 0.75, 1.0]
    assert "eval_accuracy" not in history[0]  # a null in metrics.jsonl is not a point
