import json
import random
from pathlib import Path

import pytest


def make_run(folder: Path, steps: int = 12, mode: str = "async", grids: int = 0) -> Path:
    """A run folder as the loop writes it: metrics.jsonl (step 0 = evaluation only), warm_start.jsonl,
    config.yaml and, for a diffusion-like run, sample grids."""
    from matplotlib.figure import Figure

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "eval_accuracy": 0.1, "eval_reward_mean": 0.1}]
    for s in range(1, steps + 1):
        r = {"step": s, "reward_mean": 0.1 + 0.03 * s + 0.02 * rng.random(), "groups_kept": 8,
             "staleness_mean": 0.5 if mode == "async" else 0.0, "rollout_seconds": 1.0 + 0.1 * rng.random(),
             "train_seconds": 0.5, "weight_sync_seconds": 0.1, "weight_sync_bytes": 4_000_000,
             "step_seconds": 1.7, "train_rollout_logprob_abs_diff": 0.01 * rng.random(), "kl": 0.01 * s,
             "loss": None if s == 5 else 0.3, "weight_version": s}
        if mode == "async":
            r.update(buffer_depth=float(s % 4), staleness_max=1, trainer_idle_seconds=0.05)
        if s % 4 == 0 or s == steps:
            r["eval_accuracy"] = 0.1 + 0.05 * s
        rows.append(r)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "warm_start.jsonl").write_text("".join(
        json.dumps({"step": s, "eval_accuracy": 0.02 * s, "sft_loss": 2.0 / s}) + "\n" for s in range(5, 30, 5)))
    (folder / "config.yaml").write_text(f"model: {{name: hf}}\nalgorithm: {{name: grpo}}\n"
                                        f"run: {{steps: {steps}, mode: {mode}}}\n")
    for i in range(grids):
        (folder / "samples").mkdir(exist_ok=True)
        fig = Figure(figsize=(2, 2))
        fig.add_subplot().imshow([[rng.random() for _ in range(8)] for _ in range(8)])
        fig.savefig(folder / "samples" / f"step_{i:06d}.png")
    return folder


@pytest.fixture(scope="session")
def async_report(tmp_path_factory):
    """An async, diffusion-like run (10 sample grids) and its report page."""
    from miles_plugin_report.report import write_report

    run = make_run(tmp_path_factory.mktemp("async") / "run", grids=10)
    return run, write_report(run)
