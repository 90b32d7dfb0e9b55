"""Helpers the metric-sink (logger) plugins share: the run's config, numeric metrics, and the
points a resumed run must not log a second time. Never imports the kernel."""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import yaml

__all__ = ["HeldPoints", "config_text", "earlier_rows", "numeric", "read_config"]


def read_config(config: dict[str, Any] | None, out_dir: str) -> dict[str, Any]:
    """The run's config: the one passed in, else the run folder's ``config.yaml``, else ``{}``."""
    if config is not None:
        return config
    path = os.path.join(out_dir, "config.yaml")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return yaml.safe_load(f) or {}


def config_text(config: dict[str, Any] | None, out_dir: str) -> str | None:
    """The run's config as YAML text: the one passed in, else the run folder's ``config.yaml``
    as written; ``None`` when there is neither."""
    if config is None:
        path = os.path.join(out_dir, "config.yaml")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return f.read()
    return yaml.safe_dump(config, sort_keys=False)


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a step as floats (bools as 0/1; NaN and inf kept, they are a signal);
    strings, lists and ``None`` are not numbers."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def earlier_rows(out_dir: str, before: int) -> list[tuple[int, dict[str, Any]]]:
    """``(step, metrics)`` of the run folder's ``metrics.jsonl`` rows with ``step < before``.

    A resumed run's file holds exactly the steps up to its checkpoint (the rerun drops the later
    ones before any logger opens), so these are the points a sink must hold once the rerun goes
    on; a sink whose writer lost some of them in the kill (buffered, never flushed) logs them
    again from here. A line cut off by the kill is skipped."""
    path = os.path.join(out_dir, "metrics.jsonl")
    rows: list[tuple[int, dict[str, Any]]] = []
    if not os.path.isfile(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            step = row.pop("step", None) if isinstance(row, dict) else None
            if isinstance(step, int) and step < before:
                rows.append((step, row))
    return sorted(rows, key=lambda r: r[0])


class HeldPoints:
    """The ``(metric, step)`` points a store already holds for a run that is being resumed.

    A killed run may have logged steps after its last checkpoint; the rerun resumes at that
    checkpoint and logs those steps again. A store that cannot delete points keeps the ones it has
    and the rerun leaves those pairs out (``fresh``), so every metric keeps one point per step;
    points before the first step it logs that the store lacks come from ``earlier_rows``.
    """

    def __init__(self, points: Iterable[tuple[str, int]] = ()):
        self._held: set[tuple[str, int]] = set(points)
        self.last_step = max((s for _, s in self._held), default=-1)

    def __len__(self) -> int:
        return len(self._held)

    def fresh(self, step: int, values: dict[str, float]) -> dict[str, float]:
        """The metrics of ``step`` the store does not hold yet (all of them for a new run)."""
        if not self._held or step > self.last_step:
            return values
        return {k: v for k, v in values.items() if (k, step) not in self._held}

