"""Atomic checkpoints in ``out_dir/checkpoints/step_NNNNNN`` and resume bookkeeping."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

STATE = "state.json"


def latest(out_dir: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint (its folder and state), or None."""
    for d in sorted((Path(out_dir) / "checkpoints").glob("step_*"), reverse=True):
        try:
            return d, json.loads((d / STATE).read_text())
        except (OSError, ValueError):
            continue  # an incomplete folder cannot exist (atomic rename) unless edited by hand
    return None


def begin(out_dir: str, step: int) -> Path:
    """A fresh temp folder for step ``step`` (every trainer rank writes its part into it)."""
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def commit(tmp: Path, step: int, state: dict[str, Any], keep: int) -> None:
    """Seal a filled temp folder: state file, fsync, atomic rename, prune old checkpoints (and any
    temp folders that crashed runs left)."""
    root = tmp.parent
    final = root / f"step_{step:06d}"
    (tmp / STATE).write_text(json.dumps({**state, "step": step}))
    for f in tmp.rglob("*"):
        if f.is_file():
            fsync_path(str(f))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(str(root))
    for old in [*sorted(root.glob("step_*"))[:-keep], *root.glob(".tmp-step_*")]:
        shutil.rmtree(old, ignore_errors=True)


def fsync_path(path: str) -> None:
    """fsync a file or folder (a folder's fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see either the old file or the whole new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def truncate_metrics(path: str, last_step: int | None) -> None:
    """Drop rows logged after the checkpoint we resume from (they will be redone), atomically."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill mid-write
            if last_step is not None and row.get("step", -1) <= last_step:
                keep.append(json.dumps(row) + "\n")
    write_atomic(path, "".join(keep))
