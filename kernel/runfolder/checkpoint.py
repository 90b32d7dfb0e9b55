"""Atomic, checksummed checkpoints in ``out_dir/checkpoints/step_NNNNNN`` and resume bookkeeping."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ..errors import MilesError

from .files import check_writable, disk_errors, fsync_path, write_atomic
from .metrics import highest_step

STATE = "state.json"
RUN_FILES = ("config.yaml", "metrics.jsonl", "warm_start.jsonl", "checkpoints")


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def damage(d: Path) -> str | None:
    """Why checkpoint folder ``d`` cannot be trusted (missing/resized/changed file), or None."""
    try:
        files = json.loads((d / STATE).read_text()).get("files", {})
    except (OSError, ValueError):
        return f"{STATE} is missing or unreadable"
    for rel, (size, sha) in files.items():
        f = d / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size or _digest(f) != sha:  # the size check is free; the hash catches the rest
            return f"{rel} does not match its checksum"
    return None


def latest(out_dir: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint (its folder and state), or None. A damaged newer one is
    reported on stderr and skipped."""
    for d in sorted((Path(out_dir) / "checkpoints").glob("step_*"), reverse=True):
        why = damage(d)
        if why is None:
            return d, json.loads((d / STATE).read_text())
        if os.environ.get("RANK", "0") == "0":
            print(f"miles: warning: checkpoint {d} is damaged ({why}); skipping it", file=sys.stderr)
    return None


def check_resumable(out_dir: str, found: Any) -> None:
    """Refuse to start over where training steps would be lost: metric rows past step 0 but no
    intact checkpoint."""
    last = highest_step(Path(out_dir) / "metrics.jsonl")
    if not found and last > 0:
        raise MilesError(f"{out_dir} has metrics up to step {last} but no intact checkpoint to resume from; "
                         f"starting over would drop them: move the folder aside or pick a new run.out_dir")


def check_out_dir(out_dir: str) -> None:
    """``run.out_dir`` must be a folder miles can write (checked by a probe, not by its mode bits), and
    an existing non-empty one a miles run folder (this run's to resume)."""
    p = Path(out_dir)
    if p.exists() and not p.is_dir():
        raise MilesError(f"run.out_dir {out_dir} is a file; point it at a folder")
    check_writable(p)
    if (p / "checkpoints").exists() and not (p / "checkpoints").is_dir():
        raise MilesError(f"{p / 'checkpoints'} is a file, where the run keeps its checkpoint folders; move it "
                         f"aside or pick a new run.out_dir")
    if p.is_dir() and any(p.iterdir()) and not any((p / f).exists() for f in RUN_FILES):
        raise MilesError(f"run.out_dir {out_dir} is a non-empty folder that holds no miles run "
                         f"(no {', '.join(RUN_FILES)}); pick a new or empty folder")


def begin(out_dir: str, step: int) -> Path:
    """A fresh temp folder for step ``step`` (every trainer rank writes its part into it); temp
    folders that killed runs left are removed first, so they cannot fill the disk."""
    root = Path(out_dir) / "checkpoints"
    with disk_errors(root):
        root.mkdir(parents=True, exist_ok=True)
        for old in root.glob(".tmp-step_*"):
            shutil.rmtree(old, ignore_errors=True)
        tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
        tmp.mkdir()
    return tmp


def commit(tmp: Path, step: int, state: dict[str, Any], keep: int) -> None:
    """Seal a filled temp folder: checksums of every file into the state file, fsync, atomic
    rename, prune old checkpoints."""
    root = tmp.parent
    final = root / f"step_{step:06d}"
    with disk_errors(root, tmp):
        files = {}
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                fsync_path(str(f))
                files[str(f.relative_to(tmp))] = [f.stat().st_size, _digest(f)]
        write_atomic(str(tmp / STATE), json.dumps({**state, "step": step, "files": files}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(str(root))
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
