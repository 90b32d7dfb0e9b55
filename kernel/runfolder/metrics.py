"""``metrics.jsonl``: one JSON object per training step, flushed every line, truncated on resume."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .files import disk_errors, write_atomic


class MetricsLog:
    """Appends one JSON object per step to ``out_dir/filename``, each row written whole or not at all
    (a failed write, e.g. a full disk, is cut back off so no half row stays); a non-finite float is
    written as ``null`` (JSON has no NaN). Also the ``jsonl`` logger."""

    def __init__(self, cfg: Any = None, *, out_dir: str, filename: str = "metrics.jsonl", **_: Any) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, filename)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, step: int, m: dict[str, Any]) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in m.items()}}
        data, end = (json.dumps(row) + "\n").encode(), os.lseek(self.fd, 0, os.SEEK_END)
        with disk_errors(Path(self.path).parent):
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError:
                os.ftruncate(self.fd, end)
                raise

    def close(self) -> None:
        os.close(self.fd)


def _row_step(line: bytes) -> int | None:
    try:
        return json.loads(line).get("step", -1)
    except (ValueError, AttributeError):
        return None  # a line cut by a kill mid-write, or bytes that are no UTF-8 text


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines() if path.is_file() else []


def highest_step(path: str | Path) -> int:
    """The highest step logged in a metrics file (0 when it is missing or empty)."""
    return max((s or 0 for s in map(_row_step, _lines(Path(path)))), default=0)


def truncate_metrics(path: str, last_step: int | None) -> None:
    """Drop rows logged after the checkpoint we resume from (they will be redone), and rows that
    are not JSON, atomically; an unchanged file is not rewritten."""
    if not os.path.exists(path):
        return
    data = Path(path).read_bytes()
    steps = [(line, _row_step(line)) for line in data.splitlines()]
    keep = b"".join(line + b"\n" for line, s in steps if None not in (s, last_step) and s <= last_step)
    if keep != data:
        write_atomic(path, keep)
