"""``write_report``: one HTML page with every figure embedded (base64 PNGs, inline CSS, no script,
no link): it opens offline, from a mail attachment or a CI artifact alike."""
from __future__ import annotations

import base64
import datetime
import html
import math
from pathlib import Path
from typing import Any

import yaml
from miles import MilesError

from . import plots
from .data import Run, read_run

MAX_GRIDS = 6  # sample grids shown: evenly spaced over the run, first and last included

CSS = """body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1400px;color:#222;background:#fff}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{padding:3px 12px 3px 0;text-align:left;font-size:14px}
img{max-width:100%;display:block}figure{margin:8px 0}figcaption{font-size:13px;color:#555}
pre{background:#f6f6f6;padding:10px;font-size:12px;overflow:auto}.grids{display:flex;flex-wrap:wrap;gap:12px}"""


def _img(png: bytes, alt: str, img_id: str) -> str:
    data = base64.b64encode(png).decode()
    return f'<img id="{img_id}" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.4g}"
    return html.escape(str(v))


def summary(run: Run) -> list[tuple[str, Any]]:
    """The headline facts of a run: what ran and how it ended."""
    cfg, rows = run.config, run.rows
    facts: list[tuple[str, Any]] = [("run folder", str(run.folder.resolve()))]
    for section in ("model", "env", "algorithm", "trainer", "engine", "transport", "sync"):
        if isinstance(cfg.get(section), dict) and cfg[section].get("name"):
            facts.append((section, cfg[section]["name"]))
    run_cfg = cfg.get("run") if isinstance(cfg.get("run"), dict) else {}
    facts.append(("mode", run_cfg.get("mode", "sync")))
    last = rows[-1]["step"] if rows else None
    facts.append(("steps logged", f"{last} of {run_cfg.get('steps', '?')}" if last is not None else "none"))
    _, acc = run.series("eval_accuracy")
    acc = [a for a in acc if not math.isnan(a)]
    if acc:
        facts.append(("eval accuracy", f"{acc[0]:.3f} → {acc[-1]:.3f} (best {max(acc):.3f})"))
    _, seconds = run.series("step_seconds")
    if seconds:
        total = sum(s for s in seconds if not math.isnan(s))
        facts.append(("training time", f"{total:.1f} s over {len(seconds)} steps"))
    _, nbytes = run.series("weight_sync_bytes")
    if nbytes:
        syncs = f"{len(nbytes)} sync" + "s" * (len(nbytes) != 1)
        facts.append(("weight sync", f"{syncs}, {nbytes[-1] * plots.MB:.2f} MB each (last)"))
    return facts


def _pick_grids(grids: list[Path]) -> list[Path]:
    if len(grids) <= MAX_GRIDS:
        return grids
    idx = sorted({round(i * (len(grids) - 1) / (MAX_GRIDS - 1)) for i in range(MAX_GRIDS)})
    return [grids[i] for i in idx]


def render(run: Run, figures: list[tuple[str, str, bytes]]) -> str:
    """The page: summary table, figures, sample grids, config."""
    name = html.escape(run.folder.resolve().name)
    head = (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>miles report: {name}</title>"
            f"<style>{CSS}</style></head><body>\n<h1>miles run report: {name}</h1>")
    parts = [head,
             "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{_fmt(v)}</td></tr>"
                                 for k, v in summary(run)) + "</table>"]
    for fig_id, title, png in figures:
        parts.append(f"<h2>{html.escape(title)}</h2><figure>{_img(png, title, 'fig-' + fig_id)}</figure>")
    if run.sample_grids:
        parts.append("<h2>Samples</h2><div class=grids>")
        for path in _pick_grids(run.sample_grids):
            parts.append(f"<figure>{_img(path.read_bytes(), path.stem, 'grid-' + path.stem)}"
                         f"<figcaption>{html.escape(path.stem.replace('_', ' '))}</figcaption></figure>")
        parts.append("</div>")
    if run.config:
        parts.append(f"<h2>Config</h2><pre>{html.escape(yaml.safe_dump(run.config, sort_keys=False))}</pre>")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts.append(f"<p style='color:#777;font-size:12px'>written {stamp} from {len(run.rows)} metrics rows</p>"
                 "</body></html>")
    return "\n".join(parts)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``index.html`` and one PNG per figure into ``out`` (default ``RUN_DIR/report``);
    return the page's path."""
    run = read_run(run_dir)
    out = Path(out) if out else run.folder / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MilesError(f"cannot write the report in {out}: {e.strerror}; pass --out with a folder you "
                         f"can write") from None
    figures: list[tuple[str, str, bytes]] = []
    for panel in plots.panels(run):
        png = plots.draw_panel(run, panel)
        if png:
            figures.append((panel.id, panel.title, png))
    for fig_id, title, draw in (("warm_start", "Warm start (supervised, before RL)", plots.draw_warm_start),
                                ("other", "Other metrics", plots.draw_others)):
        png = draw(run)
        if png:
            figures.append((fig_id, title, png))
    page = out / "index.html"
    try:
        for fig_id, _, png in figures:
            (out / f"{fig_id}.png").write_bytes(png)
        page.write_text(render(run, figures))
    except OSError as e:
        raise MilesError(f"cannot write the report in {out}: {e.strerror}; pass --out with a folder you "
                         f"can write") from None
    return page


class ReportLogger:
    """Logger ``report``: writes ``<run.out_dir>/report/index.html`` when the run ends (also when it
    stops early: the page shows the steps that were logged)."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass  # the page is drawn from metrics.jsonl, which the kernel writes

    def close(self) -> None:
        import sys

        try:
            page = write_report(self.out_dir)
        except Exception as e:  # a report must never hide why a run ended
            print(f"miles: warning: no run report written: {type(e).__name__}: {e}", file=sys.stderr)
            return
        print(f"run report: {page}")
