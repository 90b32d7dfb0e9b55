"""What RL adds over demonstrations: GRPO vs continued SFT from the same warm start, same time.

For each seed: run the quickstart's supervised warm start once, then (a) GRPO for the recipe's
``run.steps`` and (b) continued supervised training on the same demonstrations (the warm start's
own algorithm and learning rate) from the same weights for the same wall time. Prints held-out
greedy accuracy at the start and end of each, and the gains.

    python benchmarks/quickstart_vs_sft.py [--seeds 0,1,2] [--steps N]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_seed(seed: int, steps: int | None, out: str, warm: dict[str, int] | None = None,
             extra: tuple[str, ...] = ()) -> dict[str, float]:
    from miles.config import apply_overrides, read_yaml, resolve
    from miles.loop import Loop
    from miles.plugins import make_plugin_manager
    from miles_plugin_sft.demos import demo_samples
    from miles_plugin_sft.warmstart import settings, trainer_settings

    over = [f"run.seed={seed}", f"run.out_dir={out}/seed{seed}"] + ([f"run.steps={steps}"] if steps else [])
    over += [f"run.warm_start.{k}={v}" for k, v in (warm or {}).items()] + list(extra)
    pm = make_plugin_manager()
    cfg = resolve(pm, apply_overrides(read_yaml(str(ROOT / "recipes/quickstart.yaml")), over))
    loop = Loop(pm, cfg)
    p = loop.build()
    t = time.perf_counter()
    pm.hook.miles_warm_start(run=loop, settings=cfg.run.warm_start)  # the sft plugin's phase
    warm_seconds = time.perf_counter() - t
    start_weights = {k: v.clone() for k, v in p.trainer.named_weights()}
    loop.new_trainer().load_weights(start_weights.items())  # the RL trainer starts from it, as in a run
    loop.sync()
    start = loop.evaluate()["eval_accuracy"]

    t = time.perf_counter()
    for step in range(1, cfg.run.steps + 1):
        loop.rl_step(step)
    rl_seconds = time.perf_counter() - t
    rl = loop.evaluate()["eval_accuracy"]

    # continued SFT: the warm start's algorithm and trainer settings, from the same weights
    ws = settings(cfg.run.warm_start, [])  # run.warm_start as the sft plugin reads it
    algo = pm.create("algorithms", ws.algorithm, None)
    loop.new_trainer(settings=trainer_settings(cfg, pm, ws, []), algorithm=algo).load_weights(start_weights.items())
    demos, rng = list(p.env.demonstrations()), random.Random(seed)
    t, sft_steps = time.perf_counter(), 0
    while time.perf_counter() - t < rl_seconds:
        samples = demo_samples(demos, ws.batch_size, rng, tokenizer=p.tokenizer, env=p.env,
                               rollout=loop.rollout_component, version=loop.version)
        loop.update(samples, [0.0] * ws.batch_size, algo)
        sft_steps += 1
    loop.publish()
    sft = loop.evaluate()["eval_accuracy"]
    return dict(seed=seed, start=start, rl=rl, sft=sft, warm_seconds=warm_seconds,
                rl_seconds=rl_seconds, rl_steps=cfg.run.steps, sft_steps=sft_steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the recipe's)")
    ap.add_argument("--out", default="/tmp/miles-bench-quickstart-vs-sft")
    ap.add_argument("--quick", action="store_true", help="one seed, a 4-step warm start, 2 RL steps of 8 prompts, "
                    "20 eval prompts, one thread (a smoke run)")
    args = ap.parse_args()
    warm, extra = None, ()
    if args.quick:
        args.seeds, args.steps = "0", 2
        warm = {"max_steps": 4, "min_steps": 0, "eval_every": 2}
        extra = ("env.eval_size=20", "rollout.batch_size=8", "run.threads=1")
    rows = [run_seed(int(s), args.steps, args.out, warm, extra) for s in args.seeds.split(",")]
    print(f"{'seed':>4} {'warm start':>10} {'step 0':>7} {'GRPO':>6} {'SFT':>6} {'GRPO gain':>9} "
          f"{'SFT gain':>8}  time per arm")
    for r in rows:
        print(f"{r['seed']:>4} {r['warm_seconds']:>9.0f}s {r['start']:>7.3f} {r['rl']:>6.3f} {r['sft']:>6.3f} "
              f"{r['rl'] - r['start']:>+9.3f} {r['sft'] - r['start']:>+8.3f}  {r['rl_seconds']:.0f}s "
              f"({r['rl_steps']} GRPO steps, {r['sft_steps']} SFT steps)")
    rl_gain = min(r["rl"] - r["start"] for r in rows)
    sft_gain = max(r["sft"] - r["start"] for r in rows)
    print(f"quickstart_vs_sft: GRPO gain >= {rl_gain:+.3f} on every seed, continued SFT gain <= "
          f"{sft_gain:+.3f} in the same time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
