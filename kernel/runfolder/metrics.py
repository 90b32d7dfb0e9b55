"""``metrics.jsonl``: one JSON object per training step, flushed every line, truncated on resume."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .files import write_atomic


class MetricsLog:
    """Appends one JSON object per step to ``out_dir/filename`` (flushed every line); a non-finite
    float is written as ``null`` (JSON has no NaN). Also the ``jsonl`` logger."""

    def __init__(self, cfg: Any = None, *, out_dir: str, filename: str = "metrics.jsonl", **_: Any) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.f = open(os.path.join(out_dir, filename), "a")

    def log(self, step: int, m: dict[str, Any]) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in m.items()}}
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def _row_step(line: str) -> int | None:
    try:
        return json.loads(line).get("step", -1)
    except (ValueError, AttributeError):
        return None  # a line cut by a kill mid-write


def highest_step(path: str | Path) -> int:
    """The highest step logged in a metrics file (0 when it is missing or empty)."""
    path = Path(path)
    return max((s or 0 for s in map(_row_step, path.read_text().splitlines())), default=0) if path.is_file() else 0


def truncate_metrics(path: str, last_step: int | None) -> None:
    """Drop rows logged after the checkpoint we resume from (they will be redone), atomically;
    an unchanged file is not rewritten."""
    if not os.path.exists(path):
        return
    text = Path(path).read_text()
    steps = [(line, _row_step(line)) for line in text.splitlines()]
    keep = "".join(f"{line}\n" for line, s in steps if None not in (s, last_step) and s <= last_step)
    if keep != text:
        write_atomic(path, keep)
