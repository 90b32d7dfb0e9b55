"""Checkpoints are sealed atomically and verified on resume; metric rows past a checkpoint are dropped."""
from __future__ import annotations

import json

import pytest

from miles import MilesError
from miles.runfolder import begin, check_out_dir, check_resumable, commit, latest, truncate_metrics


def _checkpoint(out, step, payload=b"weights"):
    tmp = begin(str(out), step)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "w.bin").write_bytes(payload)
    commit(tmp, step, {"weight_version": step}, keep=2)


def test_latest_is_the_newest_intact_checkpoint_and_old_ones_are_pruned(tmp_path, capsys):
    for step in (1, 2, 3):
        _checkpoint(tmp_path, step)
    assert [d.name for d in sorted((tmp_path / "checkpoints").iterdir())] == ["step_000002", "step_000003"]
    d, state = latest(str(tmp_path))
    assert (d.name, state["step"], state["weight_version"]) == ("step_000003", 3, 3)
    (d / "trainer" / "w.bin").write_bytes(b"weightz")  # same size, other bytes: only the hash sees it
    d, state = latest(str(tmp_path))
    assert state["step"] == 2
    assert "does not match its checksum" in capsys.readouterr().err


def test_metrics_past_the_checkpoint_are_dropped_and_a_lost_run_is_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)) + '{"step": 5, "cut')
    truncate_metrics(str(path), 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    with pytest.raises(MilesError, match="metrics up to step 2 but no intact checkpoint"):
        check_resumable(str(tmp_path), None)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(MilesError, match="holds no miles run"):
        check_out_dir(str(tmp_path / "other"))
