"""The report's figures, drawn with matplotlib's object API (no pyplot: no global backend or
figure state is touched in the calling process)."""
from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass

from .data import Run

MB = 1e-6


@dataclass
class Panel:
    """One figure: a titled row of subplots, each drawing some metrics against the step."""
    id: str
    title: str
    subplots: list[tuple[str, list[str]]]  # (y label, metric keys)
    scale: dict[str, float] | None = None  # key -> factor applied before drawing
    wanted: Callable[[Run], bool] | None = None  # extra condition besides "some key is present"


def _async_run(run: Run) -> bool:
    """Async runs log a buffer depth; sync runs log staleness 0.0 on every step, not worth a figure."""
    return "buffer_depth" in run.numeric_keys() or any(v > 0 for v in run.series("staleness_mean")[1]
                                                       if not math.isnan(v))


def panels(run: Run) -> list[Panel]:
    keys = run.numeric_keys()
    sync_seconds = [k for k in keys if k.startswith("weight_sync_") and k.endswith("_seconds")]
    main = "train_rollout_logprob_abs_diff"
    mismatch = [main] + [k for k in keys if "logprob" in k and ("diff" in k or "mismatch" in k) and k != main]
    return [
        Panel("reward", "Reward and evaluation accuracy",
              [("reward", ["reward_mean", "eval_reward_mean"]), ("accuracy", ["eval_accuracy"]),
               ("diversity", ["diversity", "eval_diversity"])]),
        Panel("timings", "Step timings",
              [("seconds per step", ["rollout_seconds", "train_seconds", "weight_sync_seconds",
                                     "logprobs_seconds", "step_seconds"])]),
        Panel("weight_sync", "Weight sync",
              [("MB per sync", ["weight_sync_bytes"]), ("seconds", sync_seconds or ["weight_sync_seconds"])],
              scale={"weight_sync_bytes": MB}),
        Panel("async", "Staleness and buffer (async)",
              [("weight versions behind", ["staleness_mean", "staleness_max"]),
               ("groups", ["buffer_depth", "groups_dropped_stale"]),
               ("idle seconds", ["trainer_idle_seconds", "engine_idle_seconds"])], wanted=_async_run),
        Panel("mismatch", "Log-prob mismatch, training vs rollout", [("mean |Δ log p|", mismatch)]),
    ]


def shown_keys(run: Run) -> set[str]:
    return {k for p in panels(run) for _, ks in p.subplots for k in ks}


def _draw(ax, run: Run, keys: list[str], label: str, rows=None, scale: dict[str, float] | None = None) -> bool:
    drew = False
    for key in keys:
        steps, values = run.series(key, rows)
        if not steps:
            continue
        factor = (scale or {}).get(key, 1.0)
        ax.plot(steps, [v * factor for v in values], marker="o" if len(steps) <= 40 else None,
                markersize=3, label=key)
        drew = True
    if drew:
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return drew


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def _figure(n: int, rows: int = 1, cols: int | None = None):
    from matplotlib.figure import Figure

    cols = cols or n
    fig = Figure(figsize=(4.6 * cols, 3.2 * rows), layout="constrained")
    return fig, [fig.add_subplot(rows, cols, i + 1) for i in range(n)]


def draw_panel(run: Run, panel: Panel) -> bytes | None:
    """The panel's PNG, or None when the run has none of its metrics."""
    present = set(run.numeric_keys())
    subplots = [(label, [k for k in ks if k in present]) for label, ks in panel.subplots]
    subplots = [(label, ks) for label, ks in subplots if ks]
    if not subplots or (panel.wanted and not panel.wanted(run)):
        return None
    fig, axes = _figure(len(subplots))
    for ax, (label, ks) in zip(axes, subplots):
        _draw(ax, run, ks, label, scale=panel.scale)
    return _png(fig)


def draw_warm_start(run: Run) -> bytes | None:
    """Evaluation accuracy and supervised loss over the warm start's steps."""
    keys = [k for k in ("eval_accuracy", "sft_loss") if run.series(k, run.warm_start)[0]]
    if not keys:
        return None
    fig, axes = _figure(len(keys))
    for ax, key in zip(axes, keys):
        _draw(ax, run, [key], key, rows=run.warm_start)
    return _png(fig)


def draw_others(run: Run, limit: int = 36) -> bytes | None:
    """Small multiples of every numeric metric no other figure shows."""
    keys = [k for k in run.numeric_keys() if k not in shown_keys(run)][:limit]
    if not keys:
        return None
    cols = min(4, len(keys))
    fig, axes = _figure(len(keys), rows=math.ceil(len(keys) / cols), cols=cols)
    for ax, key in zip(axes, keys):
        steps, values = run.series(key)
        ax.plot(steps, values, marker="o" if len(steps) <= 40 else None, markersize=2)
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    return _png(fig)
