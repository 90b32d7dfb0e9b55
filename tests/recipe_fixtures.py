"""One supervised warm start for the recipe learning tests of every test file and xdist worker.

``warm_run`` runs ``recipes/reinforce_pp.yaml`` with ``run.steps=0``: the recipe's warm start on
the sloppy teacher (stopped at its plateau, ~0.5 greedy eval accuracy), written as the step-0
checkpoint with its ``eval_accuracy`` row. That recipe needs a reference model, so the checkpoint
carries one for every algorithm that resumes from it. ``warm_export`` is the same model as a
Hugging Face folder (a LoRA base, a student to distill, the start of another recipe).

Both are made once per pytest run: under xdist the first worker to ask builds them in the run's
shared temporary folder while holding a file lock, and the others reuse them, so the ~300 warm-start
steps are not trained again by each test file. Callers copy the run folder before training on it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]


def _shared_dir(tmp_path_factory) -> Path:
    """This pytest run's temporary folder, the same for every xdist worker of the run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def miles(*args: str, timeout: int = 2400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "miles.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def warm_run(tmp_path_factory) -> Path:
    shared = _shared_dir(tmp_path_factory) / "recipe-warm-start"
    out, done = shared / "run", shared / "run.done"
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared / "lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a failed attempt's partial run would be resumed
            r = miles("train", "recipes/reinforce_pp.yaml", f"run.out_dir={out}", "run.steps=0")
            assert r.returncode == 0, r.stderr[-3000:]
            done.touch()
    return out


def warm_export(tmp_path_factory) -> Path:
    run = warm_run(tmp_path_factory)
    folder, done = run.parent / "export", run.parent / "export.done"
    with FileLock(str(run.parent / "lock")):
        if not done.exists():
            from miles.cli import main

            assert main(["export", str(run), "--to", str(folder)]) == 0
            done.touch()
    return folder
