"""Launcher overhead: the quickstart recipe's steps under the ``local`` and ``ray`` launchers.

Both place the same processes on this machine: one trainer rank and one ``miles serve`` engine
(driven over HTTP by the ``sglang`` client), with the same transport. Each launcher runs
``--steps`` GRPO steps of ``recipes/quickstart.yaml`` (no warm start: the steps' cost, not the
model's quality, is measured) in ``--repeat`` alternating rounds (load from other processes then
hits both alike). A step's time is ``step_seconds`` from ``metrics.jsonl``; the first
``--skip`` steps of each run (first requests, first weight push) are left out and the median of
the rest is kept, best round of each launcher. Start-up (launch until the first step is logged:
Ray's start plus placement, or the local processes' start) is reported separately.

    python benchmarks/launcher_overhead.py [--steps 20] [--repeat 2] [--skip 3]

The last line reads ``launcher_overhead ray/local step time ratio R (target <= 1.10)``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "quickstart.yaml")
# --quick: 8 prompts a step, an 8-prompt step-0 eval, one torch thread (the run's phases once each,
# at the least work)
QUICK = ("rollout.batch_size=8", "env.eval_size=8", "run.threads=1")


def run_once(launcher: str, steps: int, skip: int, work: Path, env: dict[str, str],
             extra_overrides: tuple[str, ...] = ()) -> tuple[float, float]:
    """(median step seconds after ``skip`` steps, seconds from launch to the first logged step)."""
    out = Path(tempfile.mkdtemp(prefix=f"{launcher}-", dir=work))
    extra = ["launcher.num_cpus=2"] if launcher == "ray" else []
    cmd = [sys.executable, "-m", "miles.cli", "train", RECIPE, f"run.out_dir={out}", f"run.steps={steps}",
           "run.warm_start=null", "run.eval_every=1000", "run.checkpoint_every=1000", "env.eval_size=50",
           f"launcher.name={launcher}", "launcher.engines=1", "launcher.trainer_ranks=1", *extra, *extra_overrides]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, first = out / "metrics.jsonl", None
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.read_text().strip():
            first = time.monotonic() - t0
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(f"{launcher} run failed ({proc.returncode}):\n{proc.stderr.read()[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["step_seconds"] for r in rows if r["step"] > skip and "step_seconds" in r]
    return statistics.median(times), first or float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 steps, no skip, 1 round, 8 prompts a step (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeat, args.skip = 2, 1, 0
    work = Path(tempfile.mkdtemp(prefix="mlo", dir="/tmp"))  # short: Ray's socket paths are limited
    env = {**os.environ, "HOME": str(work), "RAY_TMPDIR": str(work / "r"), "RAY_AUTH_MODE": "disabled"}
    best: dict[str, tuple[float, float]] = {}
    try:
        for i in range(args.repeat):
            for launcher in ("local", "ray"):
                step, start = run_once(launcher, args.steps, args.skip, work, env, QUICK if args.quick else ())
                print(f"round {i}: {launcher:5s} median step {step * 1000:7.1f} ms  start-up {start:5.1f} s",
                      flush=True)
                old = best.get(launcher)
                best[launcher] = (min(step, old[0]), min(start, old[1])) if old else (step, start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for launcher, (step, start) in best.items():
        print(f"{launcher:5s} best median step {step * 1000:7.1f} ms, start-up {start:5.1f} s")
    print(f"launcher_overhead ray/local step time ratio {best['ray'][0] / best['local'][0]:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
