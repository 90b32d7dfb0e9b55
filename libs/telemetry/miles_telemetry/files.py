"""The run folder's telemetry files and how to read them while a run writes them.

``RUN/telemetry/``: ``timeline.jsonl`` (one line per step: its spans), ``samples.jsonl`` (sampled
trajectories with per-token log-prob pairs) and ``devices.jsonl`` (device and engine readings).
The last two rotate (``samples.1.jsonl`` is the previous file, and so on) under a size cap.
Readers tolerate what a killed or running process leaves: a line cut short, a missing file, a file
rewritten by a resumed run.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FOLDER = "telemetry"
TIMELINE, SAMPLES, DEVICES = "timeline.jsonl", "samples.jsonl", "devices.jsonl"


class RotatingJsonl:
    """Appends JSON lines to ``path``; when it passes ``max_bytes / keep`` it becomes ``.1`` (the
    older ones shift, the oldest beyond ``keep`` is removed), so the files never hold more than
    about ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int, keep: int = 4) -> None:
        self.path, self.keep = path, max(1, keep)
        self.limit = max(4096, max_bytes // self.keep)
        self.f = open(path, "a")
        self.size = self.f.tell()

    def _rotated(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.{i}{self.path.suffix}")

    def write(self, row: dict[str, Any]) -> None:
        try:
            line = json.dumps(row, allow_nan=False) + "\n"
        except ValueError:  # a NaN/inf (a diverged step's log-prob): JSON has none, null instead
            line = json.dumps(finite(row)) + "\n"
        if self.size and self.size + len(line) > self.limit:
            self.f.close()
            self._rotated(self.keep - 1).unlink(missing_ok=True)
            for i in range(self.keep - 2, 0, -1):
                if self._rotated(i).exists():
                    os.replace(self._rotated(i), self._rotated(i + 1))
            if self.keep > 1:
                os.replace(self.path, self._rotated(1))
            else:
                self.path.unlink(missing_ok=True)
            self.f, self.size = open(self.path, "a"), 0
        self.f.write(line)
        self.f.flush()
        self.size += len(line)

    def close(self) -> None:
        self.f.close()


def finite(x: Any) -> Any:
    """``x`` with every non-finite float (anywhere in lists and dicts) replaced by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def rotated_files(path: Path) -> list[Path]:
    """``path`` and its rotated predecessors, oldest first."""
    older = []
    for p in path.parent.glob(f"{path.stem}.*{path.suffix}"):
        middle = p.name[len(path.stem) + 1:-len(path.suffix)]
        if middle.isdigit():
            older.append((int(middle), p))
    return [p for _, p in sorted(older, reverse=True)] + ([path] if path.exists() else [])


def parse_lines(text: str, source: str) -> tuple[list[dict[str, Any]], list[str]]:
    """JSON objects of a JSON-lines text and the problems with the other lines (named by file and line)."""
    rows, problems = [], []
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            cut = i == len(lines)  # no newline after it: a writer was stopped mid-line
            problems.append(f"{source} line {i}: {'cut short' if cut else 'not JSON'} ({line[:40]!r})")
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            problems.append(f"{source} line {i}: not a JSON object")
    return rows, problems


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; lines that are not JSON objects (one cut by a kill) are skipped."""
    return parse_lines(path.read_text(errors="replace"), path.name)[0]


def latest_per_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the last one written (a resumed run's redone steps replace the old)."""
    by_step: dict[Any, dict[str, Any]] = {}
    for r in rows:
        by_step[r.get("step")] = r
    return sorted((r for s, r in by_step.items() if isinstance(s, int)), key=lambda r: r["step"])


@dataclass
class Tail:
    """Follows a JSON-lines file a process appends to: ``read()`` returns the rows completed since
    the last call. A file replaced or shortened (a resumed run truncates ``metrics.jsonl``) is
    read again from its start, and ``generation`` counts those restarts so a client can reset."""

    path: Path
    generation: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    _ino: int | None = None
    _offset: int = 0
    _line: int = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        if st.st_ino != self._ino or st.st_size < self._offset:
            if self._ino is not None:
                self.generation += 1
            self._ino, self._offset, self._line, self.rows, self.problems = st.st_ino, 0, 0, [], []
        if st.st_size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read(st.st_size - self._offset)
        end = chunk.rfind(b"\n") + 1  # an unfinished last line waits for its newline
        new, problems = parse_lines(chunk[:end].decode(errors="replace"), self.path.name)
        self.problems += [_shift(p, self._line) for p in problems]
        self._line += chunk[:end].count(b"\n")
        self._offset += end
        self.rows += new
        return new

    def pending(self) -> str | None:
        """The unfinished last line, if the file ends without a newline (a cut line, or a write
        in progress)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return None
        return f"{self.path.name} line {self._line + 1}: cut short (no newline yet)" if size > self._offset else None


def _shift(problem: str, lines_before: int) -> str:
    name, _, rest = problem.partition(" line ")
    num, _, tail = rest.partition(":")
    return f"{name} line {int(num) + lines_before}:{tail}"
