"""What recording for ``miles dashboard`` costs a run whose dashboard is closed: the quickstart's RL
steps (``recipes/quickstart.yaml``; the warm start left out, so every group is trained on rather
than dropped for zero reward variance) with ``run.telemetry`` on and off.

Three figures: the recorder's own time (the step metric ``telemetry_seconds``: spans, sample picks,
training log-prob copies, the timeline and sample lines, device readings on their thread) over the
step time, and the median step time with telemetry on over off, from runs interleaved so a busy
machine slows both alike, and the CPU seconds a step costs with telemetry on over off (the
processes' user + system time of a full run less that of a 3-step run, per extra step: other
processes' load changes wall time far more than CPU time). The target is at most 2% (a ratio of 1.02).

    python benchmarks/dashboard_overhead.py [--steps 30] [--repeats 3] [--quick] [KEY=VALUE ...]

KEY=VALUE overrides go to both runs (e.g. ``trainer.device=cuda engine.device=cuda``: on a GPU the
recorder also reads NVML every step).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(out: Path, steps: int, telemetry: bool, extra: tuple[str, ...] = ()) -> list[dict]:
    cmd = [sys.executable, "-m", "miles.cli", "train", str(ROOT / "recipes/quickstart.yaml"), "run.warm_start=null",
           "algorithm.filter_zero_variance=false",  # without the warm start every group would be dropped: train them
           f"run.steps={steps}", f"run.out_dir={out}", "run.eval_every=100000", "run.checkpoint_every=100000",
           f"run.telemetry.enabled={'true' if telemetry else 'false'}", "loggers=[]", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"miles train failed ({p.returncode}):\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 2]  # the first steps warm caches up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="3 steps (one measured), 1 repeat, 8 prompts a step, "
                    "an 8-prompt step-0 eval, one thread (a smoke run)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for both runs")
    a = ap.parse_args()
    steps, repeats = (3, 1) if a.quick else (a.steps, a.repeats)
    extra = ("rollout.batch_size=8", "env.eval_size=8", "run.threads=1") if a.quick else ()
    extra = (*extra, *a.overrides)
    on_steps, off_steps, own, total = [], [], 0.0, 0.0
    cpu = {True: 0.0, False: 0.0}  # CPU seconds of the full runs less the 3-step runs, per arm
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for telemetry in ((True, False) if i % 2 == 0 else (False, True)):  # neither always goes first
                if not a.quick:
                    before = _children_cpu()
                    run(Path(tmp) / f"{i}-{telemetry}-short", 3, telemetry, extra)
                    cpu[telemetry] -= _children_cpu() - before
                before = _children_cpu()
                rows = run(Path(tmp) / f"{i}-{telemetry}", steps, telemetry, extra)
                cpu[telemetry] += _children_cpu() - before
                (on_steps if telemetry else off_steps).extend(r["step_seconds"] for r in rows)
                if telemetry:
                    own += sum(r.get("telemetry_seconds", 0.0) for r in rows)
                    total += sum(r["step_seconds"] for r in rows)
    on, off = statistics.median(on_steps), statistics.median(off_steps)
    print(f"quickstart RL steps: {len(on_steps)} with telemetry, {len(off_steps)} without")
    print(f"recorder's own time / step time: {own / total:.4f} ({own / max(len(on_steps), 1) * 1e3:.2f} ms a step)")
    print(f"median step seconds: on {on:.4f}, off {off:.4f}")
    print(f"ratio on/off: {on / off:.3f}")
    if not a.quick:
        extra_steps = repeats * (steps - 3)
        print(f"CPU seconds a step: on {cpu[True] / extra_steps:.4f}, off {cpu[False] / extra_steps:.4f}, "
              f"ratio {cpu[True] / cpu[False]:.3f}")


if __name__ == "__main__":
    main()
