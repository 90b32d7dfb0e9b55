"""Reruns and run folders that used to give silently wrong results or tracebacks: a resume that
changes what the checkpoint means, fewer steps than already trained, evaluating nothing, folders
that cannot be written, damaged metrics and checkpoints, and a full disk while logging. Each is
refused with one message naming the cause, and the run folder stays as it was."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from miles.cli import main

TINY = str(Path(__file__).resolve().parent / "tiny.yaml")
BASE = ["run.warm_start=null", "run.threads=1", "run.checkpoint_every=1"]


def tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def miles(capfd, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capfd.readouterr()
    return code, out + err


@pytest.fixture(scope="session")
def finished(tmp_path_factory) -> Path:
    """A tiny run trained to step 3 (a checkpoint every step); tests copy it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", TINY, f"run.out_dir={out}", "run.steps=3", *BASE]) == 0
    return out


@pytest.fixture
def run(finished: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def refused(capfd, run: Path, *argv: str, command: str = "train", code: int = 2) -> str:
    before = tree(run) if run.exists() else None
    got, text = miles(capfd, command, TINY, f"run.out_dir={run}", "run.steps=3", *BASE, *argv)
    assert got == code and "Traceback" not in text and "miles: error:" in text, text
    assert (tree(run) if run.exists() else None) == before  # left as it was
    return text


@pytest.mark.parametrize("change,listed", [
    ("env.digits=2", "env.digits: 1 -> 2"),
    ("algorithm.name=gspo", "algorithm.name: 'grpo' -> 'gspo'"),
    ("model.config.model_type=llama", "model.config.model_type: 'qwen2' -> 'llama'"),
])
def test_a_resume_that_changes_what_the_checkpoint_means_is_refused(run, capfd, change, listed):
    text = refused(capfd, run, change, "run.steps=4")
    assert "trained under other settings" in text and listed in text, text


def test_safe_changes_resume_and_other_changes_are_listed(run, capfd):
    code, text = miles(capfd, "train", TINY, f"run.out_dir={run}", *BASE, "run.steps=4", "run.eval_every=1",
                       "loggers=[]", "trainer.lr=2e-3")
    assert code == 0 and "resuming with changed settings: trainer.lr 0.001 -> 0.002" in text, text
    assert "run.eval_every" not in text and "loggers" not in text.split("resuming with")[1].split("\n")[0]
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["steps"] == 4


def test_fewer_steps_than_trained_is_refused_and_as_many_is_a_no_op(run, capfd):
    text = refused(capfd, run, "run.steps=1")
    assert "run.steps=1, but" in text and "already trained 3 steps" in text, text
    before = tree(run)
    code, text = miles(capfd, "train", TINY, f"run.out_dir={run}", *BASE, "run.steps=3")
    assert code == 0 and "already trained all 3 steps; nothing to do" in text, text
    assert tree(run) == before


def test_eval_of_a_missing_or_empty_run_folder_is_an_error(tmp_path, capfd):
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (tmp_path / "missing", empty):
        code, text = miles(capfd, "eval", TINY, f"run.out_dir={folder}")
        assert code == 2 and "holds no intact checkpoint" in text and "--untrained" in text, text
    assert not (tmp_path / "missing").exists() and list(empty.iterdir()) == []


def test_folders_that_cannot_be_written_are_named(run, tmp_path, capfd):
    assert "not writable" in refused(capfd, Path("/proc/miles-run"))
    (run / "checkpoints").rename(tmp_path / "aside")
    (run / "checkpoints").write_text("")
    assert "checkpoints is a file" in refused(capfd, run)
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(loop)
    assert "symlink" in refused(capfd, loop)


@contextlib.contextmanager
def mounted(folder: Path, options: str):
    folder.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"mounting a tmpfs failed ({r.stderr.strip()}): this test needs root (CI runs as root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], capture_output=True)  # even with a file left open


def test_a_read_only_run_folder_is_named_for_new_resumed_finished_runs_and_reports(finished, tmp_path, capfd):
    with mounted(tmp_path / "ro", "size=8m") as disk:
        shutil.copytree(finished, disk / "run")
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        new, resumed, done = (disk / "new", "run.steps=3"), (disk / "run", "run.steps=4"), (disk / "run", "run.steps=3")
        for folder, steps in (new, resumed, done):
            text = refused(capfd, folder, steps)
            assert "is not writable" in text and "Read-only file system" in text and "disk full" not in text, text
        code, text = miles(capfd, "report", str(disk / "run"))
        assert code == 2 and "cannot write the report" in text and "Read-only" in text and "Traceback" not in text


def test_non_utf8_metrics_rows_are_skipped_by_resume_and_report(run, capfd):
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 9, "note": "\xff\xfe"}\n')
    code, text = miles(capfd, "train", TINY, f"run.out_dir={run}", *BASE, "run.steps=4", "loggers=[]")
    assert code == 0 and "Traceback" not in text, text
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_bytes().splitlines()] == [0, 1, 2, 3, 4]
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe\n")
    code, text = miles(capfd, "report", str(run))
    assert code == 0 and (run / "report" / "index.html").is_file(), text


def test_an_edited_checkpoint_with_recomputed_checksums_is_named(run, capfd):
    import hashlib

    ckpt = run / "checkpoints" / "step_000003"
    state = json.loads((ckpt / "state.json").read_text())
    edited = next(rel for rel in state["files"] if rel.endswith("trainer_state.json"))
    (ckpt / edited).write_text(json.dumps({"unexpected": 1}))
    data = (ckpt / edited).read_bytes()
    state["files"][edited] = [len(data), hashlib.sha256(data).hexdigest()]
    (ckpt / "state.json").write_text(json.dumps(state))
    text = refused(capfd, run, "run.steps=4")
    assert f"checkpoint {ckpt} cannot be loaded" in text and "move it aside" in text, text


def test_a_full_disk_while_logging_cuts_no_row_and_says_disk_full(tmp_path):
    from miles import MilesError
    from miles.runfolder import MetricsLog

    with mounted(tmp_path / "disk", "size=64k") as disk:
        log = MetricsLog(out_dir=str(disk))
        log.log(0, {"eval_accuracy": 0.5})
        with open(disk / "filler", "wb", buffering=0) as f:  # every free block: the next rows run out of room
            with contextlib.suppress(OSError):
                f.write(b"\0" * (shutil.disk_usage(disk).free + 4096))
        with pytest.raises(MilesError, match="disk full while writing in"):
            for step in range(1, 100):
                log.log(step, {"reward_mean": 0.25, "text": "x" * 700})
        log.close()
        rows = (disk / "metrics.jsonl").read_bytes().splitlines(keepends=True)
        assert len(rows) >= 1 and all(r.endswith(b"\n") and json.loads(r) for r in rows)  # none cut
        assert not any(p.name.startswith(".miles") for p in disk.iterdir())


def test_disk_full_is_said_only_when_the_disk_is_full(tmp_path):
    import errno

    from miles import MilesError
    from miles.runfolder import disk_errors

    for err, said in ((OSError(errno.EROFS, "Read-only file system"), "cannot write in"),
                      (OSError(errno.ENOSPC, "No space left on device"), "disk full")):
        with pytest.raises(MilesError, match=said):
            with disk_errors(Path("/proc")):  # a filesystem with 0 bytes free that is not full
                raise err
    with pytest.raises(ValueError):  # no OS error, and a disk with room: not ours to rename
        with disk_errors(tmp_path):
            raise ValueError("bad position")
