"""What a run folder holds, read without the run's plugins: metrics rows, the warm start's rows,
the config and the diffusion sample grids."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from miles import MilesError


@dataclass
class Run:
    folder: Path
    rows: list[dict[str, Any]]
    warm_start: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    sample_grids: list[Path] = field(default_factory=list)

    def series(self, key: str, rows: list[dict[str, Any]] | None = None) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the rows that have it as a number (None, the JSON
        form of NaN/inf, becomes NaN so a gap shows)."""
        steps, values = [], []
        for r in self.rows if rows is None else rows:
            if key in r and "step" in r:
                v = r[key]
                if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
                    steps.append(r["step"])
                    values.append(math.nan if v is None else float(v))
        return steps, values

    def numeric_keys(self) -> list[str]:
        """Every metric that is a number in at least one row, in first-seen order."""
        seen: dict[str, None] = {}
        for r in self.rows:
            for k, v in r.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    seen.setdefault(k, None)
        return list(seen)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a line cut short by a killed process, or one that is not UTF-8
    text, is skipped."""
    rows = []
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def latest_per_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the last one written (a file appended to by a rerun keeps the newest)."""
    by_step: dict[Any, dict[str, Any]] = {}
    for r in rows:
        by_step[r.get("step")] = r
    return sorted((r for s, r in by_step.items() if isinstance(s, int)), key=lambda r: r["step"])


def read_run(folder: str | Path) -> Run:
    folder = Path(folder)
    metrics = folder / "metrics.jsonl"
    if not folder.is_dir():
        raise MilesError(f"{folder} is not a folder; pass a run's run.out_dir to miles report")
    if not metrics.is_file():
        raise MilesError(f"{folder} is not a run folder (no metrics.jsonl); pass a run's run.out_dir "
                         f"(a run writes metrics.jsonl from its first evaluation on)")
    run = Run(folder, latest_per_step(read_jsonl(metrics)))
    if (folder / "warm_start.jsonl").is_file():
        run.warm_start = latest_per_step(read_jsonl(folder / "warm_start.jsonl"))
    if (folder / "config.yaml").is_file():
        try:
            run.config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
        except yaml.YAMLError:
            run.config = {}  # the report still shows the metrics
    run.sample_grids = sorted((folder / "samples").glob("step_*.png"))
    return run
