"""What a run folder holds, read without the run's plugins: metrics rows, the warm start's rows,
the config and the diffusion sample grids."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from miles import MilesError
from miles_telemetry import latest_per_step, read_jsonl


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
