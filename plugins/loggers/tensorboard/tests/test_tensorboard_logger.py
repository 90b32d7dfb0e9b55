"""The tensorboard logger, read back with TensorBoard's own EventAccumulator."""
import math

from miles import make_plugin_manager
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

CONFIG = {"model": {"name": "hf"}, "run": {"steps": 5, "out_dir": "x"}, "loggers": ["console", {"name": "tensorboard"}]}


def read(log_dir):
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def test_every_metric_of_every_step_and_the_config(tmp_path):
    pm = make_plugin_manager()
    assert "tensorboard" in pm.registry("loggers")
    cfg = pm.registry("loggers")["tensorboard"].config()
    lg = pm.create("loggers", "tensorboard", cfg, out_dir=str(tmp_path), total_steps=5, config=CONFIG)
    for step in range(6):
        lg.log(step, {"reward_mean": step / 10, "weight_sync_bytes": 1000 * step, "nonfinite_skipped": step == 3,
                      "loss": float("nan") if step == 2 else 1.0, "note": "text is not a scalar"})
    lg.close()
    ea = read(tmp_path / "tensorboard")
    assert set(ea.Tags()["scalars"]) == {"reward_mean", "weight_sync_bytes", "nonfinite_skipped", "loss"}
    assert [(e.step, round(e.value, 6)) for e in ea.Scalars("reward_mean")] == [(s, s / 10) for s in range(6)]
    assert [e.value for e in ea.Scalars("weight_sync_bytes")] == [1000.0 * s for s in range(6)]
    assert [e.value for e in ea.Scalars("nonfinite_skipped")] == [0, 0, 0, 1, 0, 0]
    assert math.isnan(ea.Scalars("loss")[2].value)
    text = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "model:\n  name: hf" in text and "steps: 5" in text


def test_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    """A killed run logged steps 0-4; it resumes at step 3: TensorBoard shows 3-4 once, with the new values."""
    from miles_plugin_tensorboard.logger import TensorBoardLogger

    first = TensorBoardLogger(out_dir=str(tmp_path))
    for step in range(5):
        first.log(step, {"reward_mean": float(step)})
    first.close()
    second = TensorBoardLogger(out_dir=str(tmp_path))
    for step in range(3, 7):
        second.log(step, {"reward_mean": 10.0 + step})
    second.close()
    got = [(e.step, e.value) for e in read(tmp_path / "tensorboard").Scalars("reward_mean")]
    assert got == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0), (6, 16.0)]


def test_config_from_the_run_folder_and_a_custom_log_dir(tmp_path):
    """Without a ``config`` context the run folder's config.yaml is logged."""
    from miles_plugin_tensorboard.config import TensorBoardConfig
    from miles_plugin_tensorboard.logger import TensorBoardLogger

    (tmp_path / "config.yaml").write_text("env:\n  name: arith\n")
    lg = TensorBoardLogger(TensorBoardConfig(log_dir=str(tmp_path / "tb")), out_dir=str(tmp_path))
    lg.log(0, {"eval_accuracy": 0.5})
    lg.close()
    ea = read(tmp_path / "tb")
    assert [e.value for e in ea.Scalars("eval_accuracy")] == [0.5]
    assert "name: arith" in ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_a_rerun_from_step_0_replaces_every_point(tmp_path):
    """A run killed before its first checkpoint restarts at step 0: its old points are dropped too."""
    from miles_plugin_tensorboard.logger import TensorBoardLogger

    first = TensorBoardLogger(out_dir=str(tmp_path))
    for step in range(2):
        first.log(step, {"reward_mean": float(step)})
    first.close()
    second = TensorBoardLogger(out_dir=str(tmp_path))
    for step in range(3):
        second.log(step, {"reward_mean": 10.0 + step})
    second.close()
    got = [(e.step, e.value) for e in read(tmp_path / "tensorboard").Scalars("reward_mean")]
    assert got == [(0, 10.0), (1, 11.0), (2, 12.0)]


def test_steps_a_killed_writer_never_flushed_come_back_from_metrics_jsonl(tmp_path):
    """The event files hold steps 0-1, metrics.jsonl 0-3 (the killed run's writer lost 2-3 with its
    buffer); the rerun logs 4 on: every step once, in step order, 2-3 with metrics.jsonl's values."""
    import json

    from miles_plugin_tensorboard.logger import TensorBoardLogger

    first = TensorBoardLogger(out_dir=str(tmp_path))
    for step in range(2):
        first.log(step, {"reward_mean": float(step)})
    first.close()
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward_mean": float(s), "note": "x"}) + "\n" for s in range(4)) + '{"step": 9, "rew')
    second = TensorBoardLogger(out_dir=str(tmp_path))
    second.log(4, {"reward_mean": 4.0})
    second.close()
    got = [(e.step, e.value) for e in read(tmp_path / "tensorboard").Scalars("reward_mean")]
    assert got == [(s, float(s)) for s in range(5)]
