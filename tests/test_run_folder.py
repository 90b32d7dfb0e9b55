"""The run folder is the user's data: a rejected or failed rerun leaves it as it was, the config
written is the resolved one, and no metric or warm-start row is lost or repeated."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from miles.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny.yaml")
QUICK = ["run.warm_start=null", "run.threads=1"]


def rows(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def train(out: Path, *extra: str) -> int:
    return main(["train", TINY, f"run.out_dir={out}", *QUICK, *extra])


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train(out, "run.steps=2", "run.checkpoint_every=1") == 0
    return out


def copy_run(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def test_the_written_config_is_the_resolved_one(finished):
    cfg = yaml.safe_load((finished / "config.yaml").read_text())
    assert cfg["run"]["keep_checkpoints"] == 2 and cfg["run"]["warm_start"] is None  # defaults, overrides
    assert cfg["trainer"]["name"] == "fsdp2" and cfg["trainer"]["betas"] == [0.9, 0.999]
    assert cfg["rollout"]["temperature"] == 1.0 and cfg["model"]["config"]["hidden_size"] == 32
    from miles.config import resolve
    from miles.plugins import make_plugin_manager

    again = resolve(make_plugin_manager(), cfg)  # it validates as it is
    assert again.settings("trainer").lr == 1e-3 and again.run.steps == 2


@pytest.mark.parametrize("change", [["model.config.hidden_size=64"], ["model.config.num_hidden_layers=3"]])
def test_a_rerun_rejected_at_resume_leaves_the_folder_unchanged(finished, tmp_path, capfd, change):
    out = copy_run(finished, tmp_path)
    before = tree(out)
    assert train(out, "run.steps=4", *change) == 2  # refused by the config the folder records
    err = capfd.readouterr().err
    key = change[0].split("=")[0]
    assert "trained under other settings" in err and key in err and "Traceback" not in err, err[-2000:]
    assert tree(out) == before
    (out / "config.yaml").unlink()  # without it, the checkpoint itself refuses weights of another shape
    before = tree(out)
    assert train(out, "run.steps=4", *change) == 2
    err = capfd.readouterr().err
    assert "does not fit this model" in err and "Traceback" not in err, err[-2000:]
    assert tree(out) == before


def test_an_unrelated_folder_is_not_a_run_folder(tmp_path, capfd):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"\xff\xd8 not much")
    assert train(out, "run.steps=1") == 2
    assert "holds no miles run" in capfd.readouterr().err
    assert [p.name for p in out.iterdir()] == ["holiday.jpg"]


def test_lost_checkpoints_with_metrics_are_refused_not_restarted(finished, tmp_path, capfd):
    out = copy_run(finished, tmp_path)
    shutil.rmtree(out / "checkpoints")
    before = tree(out)
    assert train(out, "run.steps=4") == 2
    err = capfd.readouterr().err
    assert "metrics up to step 2 but no intact checkpoint" in err, err[-2000:]
    assert tree(out) == before


CRASH_IN_WARM_START = """
from miles import hookimpl
CALLS = [0]

@hookimpl
def miles_loss(batch, logprobs):
    CALLS[0] += 1
    if CALLS[0] == 7:  # after the warm start logged its step-5 row
        raise RuntimeError("simulated crash in the warm start")
    return None
"""


def test_a_crash_in_the_warm_start_repeats_no_warm_start_row(tmp_path):
    plugin = tmp_path / "crash.py"
    plugin.write_text(CRASH_IN_WARM_START)
    out = tmp_path / "run"
    args = ["train", TINY, f"run.out_dir={out}", "run.threads=1", "run.steps=1",
            "run.warm_start.max_steps=10", "run.warm_start.eval_every=5", "run.warm_start.patience=10"]
    assert main([*args, "--plugin", str(plugin)]) == 2
    assert [r["step"] for r in rows(out, "warm_start.jsonl")] == [5]
    assert main(args) == 0
    assert [r["step"] for r in rows(out, "warm_start.jsonl")] == [5, 10]
    assert [r["step"] for r in rows(out)] == [0, 1]


FLOAT_LOSS = """
from miles import hookimpl

@hookimpl
def miles_loss(batch, logprobs):
    return 1.0
"""


def test_a_custom_loss_that_returns_a_float_is_named(tmp_path, capfd):
    plugin = tmp_path / "floaty.py"
    plugin.write_text(FLOAT_LOSS)
    assert train(tmp_path / "run", "run.steps=1", "algorithm.filter_zero_variance=false",
                 "--plugin", str(plugin)) == 2
    err = capfd.readouterr().err
    assert "miles_loss" in err and str(plugin) in err and "(loss tensor, metrics dict)" in err, err[-2000:]
    assert "Traceback" not in err


NAN_IN_WARM_START = """
from miles import hookimpl

@hookimpl
def miles_loss(batch, logprobs):
    if not batch.samples[0].logprobs:  # supervised warm-start batches: a NaN loss
        return (logprobs * float("nan")).sum(), {}
    return None
"""


def test_skipped_warm_start_steps_are_counted(tmp_path):
    plugin = tmp_path / "nan.py"
    plugin.write_text(NAN_IN_WARM_START)
    out = tmp_path / "run"
    assert main(["train", TINY, f"run.out_dir={out}", "run.threads=1", "run.steps=0", "--plugin", str(plugin),
                 "run.warm_start.max_steps=4", "run.warm_start.eval_every=2"]) == 0
    assert [r["nonfinite_steps"] for r in rows(out, "warm_start.jsonl")] == [2, 4]
