"""A run folder as the dashboard reads it while the run writes it: new metric rows since the last
poll, the latest timeline per step, sampled trajectories by step, device readings, and a plain list
of what is missing or damaged. It reads files only: the plugins a folder's config lists are never
imported (``miles.runfolder.folder_plugins``)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from miles.runfolder import folder_plugins
from miles_telemetry import FOLDER, Tail, latest_per_step, rotated_files
from miles_telemetry.files import DEVICES, SAMPLES, TIMELINE

LIVE_SECONDS = 30.0  # a run whose files changed this recently is shown as running
MAX_DEVICE_ROWS = 2000
STALE_LINE_SECONDS = 5.0  # a last line without its newline this long was cut by a kill


class RunView:
    """One run folder. Every method re-reads only what was appended since the last call."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder, self.name = folder, name
        self.metrics = Tail(folder / "metrics.jsonl")
        self.timeline = Tail(folder / FOLDER / TIMELINE)
        self._sample_tails: dict[int, Tail] = {}
        self._device_tails: dict[int, Tail] = {}
        self._config: tuple[float, dict[str, Any], str | None] | None = None
        self._warned_plugins = False

    # -- files -------------------------------------------------------------------------------------
    def config(self) -> tuple[dict[str, Any], str | None]:
        """The run's config.yaml (empty if missing) and a problem with it, if any."""
        p = self.folder / "config.yaml"
        try:
            mtime = p.stat().st_mtime
        except FileNotFoundError:
            return {}, "config.yaml is missing: the run's components and settings are unknown"
        if self._config is None or self._config[0] != mtime:
            try:
                data = yaml.safe_load(p.read_text(errors="replace"))
                cfg, problem = (data, None) if isinstance(data, dict) else ({}, "config.yaml is not a mapping")
            except yaml.YAMLError as e:
                cfg, problem = {}, f"config.yaml is not valid YAML ({str(e).splitlines()[0]})"
            self._config = (mtime, cfg, problem)
            listed = [x for x in cfg.get("plugins") or [] if isinstance(x, str)] if cfg else []
            if listed and not self._warned_plugins:  # the dashboard never needs them: none is imported
                folder_plugins(listed, [], False, str(p))
                self._warned_plugins = True
        return self._config[1], self._config[2]

    def metric_rows(self) -> tuple[int, list[dict[str, Any]]]:
        """(generation, rows so far): the generation changes when the file was rewritten (a
        resumed run truncates it), so a client holding older rows starts over."""
        self.metrics.read()
        return self.metrics.generation, self.metrics.rows

    def timelines(self, last: int = 50) -> list[dict[str, Any]]:
        self.timeline.read()
        return latest_per_step(self.timeline.rows)[-last:]

    def _rotating(self, tails: dict[int, Tail], path: Path) -> list[dict[str, Any]]:
        """Rows of a rotating file and its predecessors, oldest first (each file read once, then
        followed by inode as it is renamed)."""
        rows: list[dict[str, Any]] = []
        seen = set()
        for p in rotated_files(path):
            try:
                ino = p.stat().st_ino
            except FileNotFoundError:
                continue
            tail = tails.setdefault(ino, Tail(p))
            tail.path = p
            tail.read()
            rows += tail.rows
            seen.add(ino)
        for ino in set(tails) - seen:
            del tails[ino]
        return rows

    def samples(self) -> list[dict[str, Any]]:
        return self._rotating(self._sample_tails, self.folder / FOLDER / SAMPLES)

    def devices(self) -> list[dict[str, Any]]:
        return self._rotating(self._device_tails, self.folder / FOLDER / DEVICES)[-MAX_DEVICE_ROWS:]

    # -- what the page shows about the folder ------------------------------------------------------
    def status(self) -> dict[str, Any]:
        cfg, cfg_problem = self.config()
        problems = [cfg_problem] if cfg_problem else []
        if not self.folder.is_dir():
            return {"name": self.name, "folder": str(self.folder), "state": "waiting", "last_step": None,
                    "problems": [f"{self.folder} does not exist (yet): the page fills in once the run starts"]}
        gen, rows = self.metric_rows()
        if not self.metrics.path.is_file():
            problems.append("metrics.jsonl is missing: no curves (a run writes it from its first evaluation on)")
        tel = self.folder / FOLDER
        if not tel.is_dir():
            problems.append(f"{FOLDER}/ is missing: no timeline, samples or devices (the run did not record "
                            f"them, or run.telemetry.enabled was false)")
        else:
            for f, what in ((TIMELINE, "timeline"), (SAMPLES, "samples"), (DEVICES, "device readings")):
                if not (tel / f).is_file():
                    problems.append(f"{FOLDER}/{f} is missing: no {what}")
        self.timelines()
        self.samples()
        self.devices()
        tails = [self.metrics, self.timeline, *self._sample_tails.values(), *self._device_tails.values()]
        for t in tails:
            problems += [f"skipped {p}" for p in t.problems[:5]]
            if len(t.problems) > 5:
                problems.append(f"skipped {len(t.problems) - 5} more bad lines in {t.path.name}")
            cut = t.pending()
            if cut and time.time() - t.path.stat().st_mtime > STALE_LINE_SECONDS:  # not a write in progress
                problems.append(f"skipped {cut}")
        steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
        last = max(steps, default=None)
        total = (cfg.get("run") or {}).get("steps") if isinstance(cfg.get("run"), dict) else None
        changed = max((p.stat().st_mtime for p in (self.metrics.path, self.timeline.path) if p.exists()), default=0)
        state = "finished" if last is not None and total is not None and last >= total else \
            "running" if time.time() - changed < LIVE_SECONDS else "stopped"
        return {"name": self.name, "folder": str(self.folder), "state": state, "last_step": last,
                "total_steps": total, "generation": gen, "problems": problems,
                "components": {k: v.get("name") for k, v in cfg.items() if isinstance(v, dict) and "name" in v},
                "mode": (cfg.get("run") or {}).get("mode", "sync") if isinstance(cfg.get("run"), dict) else None}


def find_runs(paths: list[str]) -> list[Path]:
    """The run folders to show: each path that is a run folder (or does not exist yet: a run
    about to start), else the run folders directly inside it (a folder of runs)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists() or is_run_folder(p):
            out.append(p)
            continue
        inside = sorted(c for c in p.iterdir() if c.is_dir() and is_run_folder(c)) if p.is_dir() else []
        out += inside or [p]  # an empty folder is shown as a run that has not written anything yet
    return out


def is_run_folder(p: Path) -> bool:
    return p.is_dir() and any((p / f).exists() for f in ("metrics.jsonl", "config.yaml", FOLDER, "checkpoints"))
