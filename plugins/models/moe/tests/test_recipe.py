"""A short run of recipes/moe_r3.yaml: rollouts record experts, training steps replay them."""
import json
from pathlib import Path

from miles.cli import main
from miles.testing import assert_lazy_registration

RECIPE = Path(__file__).resolve().parents[4] / "recipes" / "moe_r3.yaml"


def test_moe_r3_recipe_short_run(tmp_path):
    out = tmp_path / "run"
    assert main(["train", str(RECIPE), f"run.out_dir={out}", "loggers=[]", "run.steps=2", "run.eval_every=2",
                 "run.warm_start.max_steps=2", "run.warm_start.min_steps=2", "run.warm_start.eval_every=2",
                 "rollout.batch_size=4", "env.eval_size=8", "algorithm.filter_zero_variance=false"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2 and all("tis_weight_mean" in r and r["nonfinite_steps"] == 0 for r in steps)
    # bf16 engine vs fp32 trainer with the engine's experts replayed: small, but not zero
    assert all(0 < r["train_rollout_logprob_abs_diff"] < 0.05 for r in steps), steps


def test_registration_is_lazy():
    assert_lazy_registration("miles_plugin_moe", "model_specs", "moe")
