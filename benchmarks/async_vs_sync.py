"""Sync vs fully asynchronous RL on the same recipe, placement and number of trained samples.

Both runs start from one warm-started model (the quickstart's supervised phase, run once and
exported), use the local launcher with one engine worker process and one trainer process (one
CPU thread each) and the quickstart's dynamic sampling (zero-variance groups dropped, the batch
refilled: rollout and training take comparable time), and train the same number of steps of
``rollout.batch_size`` groups. Only ``run.mode`` differs. Printed: samples per second of
each (trained samples / summed step time), learning at equal samples (reward over the last steps
and final greedy eval accuracy), and a PNG of both learning curves (reward vs trained samples).
The last line is the samples-per-second ratio.

    python benchmarks/async_vs_sync.py [--steps 40] [--quick] [--in-flight finish|resume]
                                       [--seed 0] [--device cpu|cuda] [--out DIR]

``--device cuda`` (a GPU pair): the engine worker on GPU 1, the trainer on GPU 0, weights pushed
over NCCL by the broadcast transport; the warm start still runs on the CPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def miles(*args: str) -> None:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "miles.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"`miles {' '.join(args)}` failed ({r.returncode}):\n{r.stderr[-3000:]}")
    print(f"  miles {args[0]} ... ({time.perf_counter() - t0:.0f} s)", flush=True)


def warm_model(work: Path) -> Path:
    """The quickstart's warm start, run once and exported as a Hugging Face folder."""
    folder = work / "warm_model"
    if folder.is_dir():
        return folder
    run = work / "warm"
    miles("train", "recipes/quickstart.yaml", f"run.out_dir={run}", "run.steps=0")
    miles("export", str(run), "--to", str(folder))
    return folder


def recipe(model: Path | None, mode: str, steps: int, out: Path, in_flight: str = "finish",
           seed: int = 0, device: str = "cpu") -> Path:
    """The run's config; ``model`` None (``--quick``): the recipe's own untrained model, a small
    batch, and every group trained (untrained, nearly every group's rewards are all equal)."""
    cfg = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    if model is not None:
        cfg["model"] = {"name": "hf", "path": str(model)}
    else:
        cfg["rollout"]["batch_size"] = 4
        cfg["env"]["eval_size"] = 4
        cfg["algorithm"]["filter_zero_variance"] = False
    cfg["run"].pop("warm_start")
    cfg["run"].update(steps=steps, out_dir=str(out), eval_every=steps, checkpoint_every=steps,
                      threads=1, mode=mode, seed=seed)
    cfg["trainer"]["warmup_steps"] = 0
    # the recipe's dynamic sampling stays on (groups whose rewards are all equal are dropped and
    # the batch is refilled), so rollout costs about what training does; enough refill rounds that
    # every step of both modes trains exactly batch_size groups (checked in summary())
    cfg["rollout"]["oversample_rounds"] = 8
    if mode == "async":  # the async mode's own settings; sync mode refuses them
        cfg["rollout"].update(max_staleness=1, in_flight=in_flight)
    cfg["launcher"] = {"name": "local", "engines": 1, "engine_threads": 1}
    if device == "cuda":  # the engine on GPU 1, the trainer on GPU 0, weights over NCCL
        cfg["launcher"].update(engine_devices=[1], trainer_devices=[0])
        cfg["transport"] = {"name": "broadcast"}
    cfg["loggers"] = [{"name": "console", "every": 10}]
    path = out.parent / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def summary(out: Path, n: int, batch: int) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    samples = [r["groups_kept"] * n for r in steps]
    short = [r["step"] for r in steps if r["groups_kept"] < batch]
    if short:
        print(f"  note: steps {short} of {out.name} trained fewer than {batch} groups")
    seconds = sum(r["step_seconds"] for r in steps)
    tail = steps[-max(1, len(steps) // 4):]
    return {"samples_per_s": sum(samples) / seconds, "seconds": seconds, "samples": sum(samples),
            "curve": [(sum(samples[: i + 1]), r["reward_mean"]) for i, r in enumerate(steps)],
            "reward_tail": sum(r["reward_mean"] for r in tail) / len(tail),
            "eval_first": rows[0]["eval_accuracy"], "eval_last": steps[-1].get("eval_accuracy"),
            "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in steps) / len(steps)}


def plot(results: dict, path: Path, device: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("  (matplotlib not installed: pip install matplotlib for the PNG)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, r in results.items():
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, label=f"{mode} ({r['samples_per_s']:.0f} samples/s)")
    ax.set_xlabel("trained samples")
    ax.set_ylabel("reward_mean")
    ax.set_title(f"miles: sync vs async GRPO (quickstart task, 1 engine + 1 trainer, {device})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"  learning curves: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="no warm start, 4 groups a step, 2 steps, "
                    "4 eval prompts (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "async_vs_sync"))
    ap.add_argument("--in-flight", default="finish", choices=["finish", "resume"],
                    help="async: requests in flight at a weight push finish on the old weights, or "
                         "are aborted and resumed on the new ones (rollout.in_flight)")
    ap.add_argument("--seed", type=int, default=0,
                    help="run.seed of both runs (the warm start keeps its own)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: engine on GPU 1, trainer on GPU 0 (needs two GPUs)")
    args = ap.parse_args()
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    steps = 2 if args.quick else args.steps
    if args.quick:
        print("--quick: the recipe's untrained model, 4 groups a step")
    else:
        print("warm start (once, shared by both runs)")
    model = None if args.quick else warm_model(work)
    rollout = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())["rollout"]
    if args.quick:
        rollout["batch_size"] = 4
    results = {}
    for mode in ("sync", "async"):
        out = work / mode
        if out.exists():
            import shutil

            shutil.rmtree(out)
        print(f"{mode}: {steps} steps")
        miles("train", str(recipe(model, mode, steps, out, args.in_flight, args.seed, args.device)))
        results[mode] = summary(out, rollout["n"], rollout["batch_size"])
    for mode, r in results.items():
        print(f"  {mode:5s}: {r['samples']} samples in {r['seconds']:.1f} s = {r['samples_per_s']:.1f} "
              f"samples/s; reward (last quarter) {r['reward_tail']:.3f}; eval_accuracy "
              f"{r['eval_first']:.3f} -> {r['eval_last']:.3f}; staleness_mean {r['staleness_mean']:.2f}")
    s, a = results["sync"], results["async"]
    print(f"  learning at equal samples: async - sync reward (last quarter) "
          f"{a['reward_tail'] - s['reward_tail']:+.3f}, final eval accuracy {a['eval_last'] - s['eval_last']:+.3f}")
    plot(results, work / f"async_vs_sync_{args.device}.png", args.device)
    print(f"async_vs_sync samples/s ratio: {a['samples_per_s'] / s['samples_per_s']:.2f}x "
          f"(async {a['samples_per_s']:.1f} vs sync {s['samples_per_s']:.1f} samples/s)")


if __name__ == "__main__":
    main()
