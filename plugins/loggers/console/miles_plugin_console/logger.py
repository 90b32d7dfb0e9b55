"""The console logger: rich step lines, and progress bars (a terminal) or throttled plain lines
(CI logs, pipes) for long phases. It is the run's ``miles.protocols.Console``."""
from __future__ import annotations

import math
import time
from typing import Any

from .config import ConsoleConfig


def _eta(seconds: float) -> str:
    """``42s`` or ``3m05s``."""
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s" if seconds >= 60 else f"{seconds:.0f}s"


class ConsoleLogger:
    """One rich line per step: reward, accuracy, tokens/s, ETA. On a terminal, also a live progress
    bar with ETA for the run's steps and for each long phase reported through ``progress`` (warm
    start, evaluation, export); elsewhere (CI logs, pipes) a phase prints a plain line at most every
    ``plain_every`` seconds, so logs stay readable."""

    plain_every = 10.0

    def __init__(self, cfg: ConsoleConfig | None = None, *, total_steps: int = 0, **_: Any):
        from rich.console import Console

        self.every = cfg.every if cfg else 1
        self.total = total_steps
        self.console = Console(highlight=False)
        self.t0 = time.perf_counter()
        self.first_step: int | None = None
        self.bar: Any = None
        self.phases: dict[str, list] = {}  # phase -> [bar task or None, start time, last plain line]

    def log(self, step: int, m: dict[str, Any]) -> None:
        if step and self.first_step is None:
            self.first_step, self.t0 = step, time.perf_counter()
        if step and self.console.is_terminal:
            self.progress("steps", step, self.total)
        if step % self.every and "eval_accuracy" not in m and step != self.total:
            return
        parts = [f"[bold]step {step}/{self.total}[/]"]
        for key, label, fmt in (("reward_mean", "reward", ".3f"), ("eval_accuracy", "eval_acc", ".3f"),
                                ("tokens_per_second", "tok/s", ",.0f"), ("step_seconds", "s/step", ".2f")):
            if key in m:
                parts.append(f"{label} {m[key]:{fmt}}")
        if step and self.first_step is not None and step > self.first_step and self.total > step:
            rate = (time.perf_counter() - self.t0) / (step - self.first_step)
            parts.append(f"ETA {_eta(rate * (self.total - step))}")
        self.console.print("  ".join(parts))

    def message(self, text: str) -> None:
        """A notice or warning line from the run (printed above any progress bar). Soft-wrapped:
        the terminal folds it, so a path or command in it is never cut into pieces."""
        self.console.print(text, soft_wrap=True)

    def progress(self, phase: str, done: int, total: int) -> None:
        """``done`` of the ``total`` units of a long phase are finished (``done == total`` ends it)."""
        now = time.perf_counter()
        task, t0, shown = self.phases.setdefault(phase, [None, now, -math.inf])
        if self.console.is_terminal:
            if self.bar is None:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

                self.bar = Progress("{task.description}", BarColumn(), MofNCompleteColumn(), "ETA",
                                    TimeRemainingColumn(), console=self.console, transient=True)
                self.bar.start()
            if task is None:  # a resumed run's steps start part-way: no burst of speed in the ETA
                task = self.phases[phase][0] = self.bar.add_task(phase, total=total, completed=done)
            self.bar.update(task, completed=done, total=total, refresh=True)
        elif done >= total or now - shown >= self.plain_every:
            self.phases[phase][2] = now
            eta = f"  ETA {_eta((now - t0) / done * (total - done))}" if 0 < done < total else ""
            self.console.print(f"{phase} {done}/{total}{eta}")
        if done >= total:
            if task is not None:
                self.bar.remove_task(task)
            del self.phases[phase]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
