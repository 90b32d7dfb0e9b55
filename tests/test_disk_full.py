"""A full disk during a checkpoint write, for real: a small tmpfs mounted in the test's folder."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from miles.cli import main

TINY = str(Path(__file__).resolve().parents[1] / "tests" / "tiny.yaml")


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train(out: Path, *extra: str) -> int:
    return main(["train", TINY, f"run.out_dir={out}", "run.warm_start=null", "run.threads=1", *extra])


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _mount_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    return r.returncode == 0


def test_full_disk_fails_the_checkpoint_cleanly_and_a_rerun_resumes(tmp_path, capfd):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "4m"):
        pytest.fail("mounting a tmpfs failed: this test needs root (CI runs as root)")
    try:
        out = disk / "run"
        assert train(out, "run.steps=2", "run.checkpoint_every=2") == 0
        good = tree(out / "checkpoints")
        filler = disk / "filler"
        free = shutil.disk_usage(disk).free
        filler.write_bytes(b"\0" * max(free - 64 * 1024, 0))  # room for metrics, not a checkpoint
        capfd.readouterr()
        assert train(out, "run.steps=4", "run.checkpoint_every=2") == 2
        err = capfd.readouterr().err
        assert "disk full" in err and str(out / "checkpoints") in err and "Traceback" not in err, err[-2000:]
        assert tree(out / "checkpoints") == good  # the previous checkpoint intact, no temp folder
        filler.unlink()
        assert train(out, "run.steps=4", "run.checkpoint_every=2") == 0
        assert "resuming from step 2" in capfd.readouterr().out
        assert [r["step"] for r in rows(out)] == [0, 1, 2, 3, 4]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
