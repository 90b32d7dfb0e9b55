"""recipes/tool_use.yaml learns to call its tool (a CI-sized run of the recipe file).

Cut to fit CI: 2-digit first factors (shorter calls to copy), a warm start of 250 steps of 64
transcripts and 10 RL steps of 16 prompts (the recipe: 3 digits, 300 x 128 and 40 x 32). The
effect is the recipe's: after the warm start the greedy model answers from its head estimate
(eval accuracy 0.01), and a few GRPO steps make it call the calculator (0.99 at step 10 in the
measured run, sampled tool calls per answer 0.30 -> 0.58 over the first and last three steps).
"""
import json
from pathlib import Path

import pytest
from miles.cli import main

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tool_use.yaml"


@pytest.mark.slow
def test_tool_use_recipe_rl_teaches_the_tool(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(RECIPE), f"run.out_dir={out}", "loggers=[]", "run.steps=10", "run.eval_every=10",
                 "run.warm_start.max_steps=250", "run.warm_start.min_steps=250", "run.warm_start.eval_every=250",
                 "run.warm_start.batch_size=64", "rollout.batch_size=16", "env.eval_size=100",
                 "env.train_size=2000", "env.a_digits=2"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    calls = [r["tool_calls_mean"] for r in rows if "tool_calls_mean" in r]
    assert len(acc) == 2 and len(calls) == 10
    assert acc[-1] - acc[0] >= 0.3, acc
    assert sum(calls[-3:]) / 3 > sum(calls[:3]) / 3 + 0.1, calls  # the task needs the tool: more calls
    assert all(r["truncated_frac"] <= 0.1 for r in rows if "truncated_frac" in r)
    # miles eval prints trajectories of the newest checkpoint: the trained model calls the tool
    capsys.readouterr()
    assert main(["eval", str(RECIPE), f"run.out_dir={out}", "loggers=[]", "env.eval_size=100", "env.train_size=2000",
                 "env.a_digits=2", "rollout.show=2"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("--- trajectory") == 2 and printed.count("prompt:") == 2
    assert "  call:     calculator(" in printed and "tool:" in printed and "answer:     =" in printed
    assert json.loads(printed.strip().splitlines()[-1])["step"] == 10


def test_multi_turn_demonstrations_need_a_rollout_that_lays_them_out(tmp_path, capsys):
    import yaml

    cfg = yaml.safe_load(RECIPE.read_text())
    cfg["rollout"] = {"batch_size": 2, "n": 2, "max_new_tokens": 4}  # the default single_turn rollout
    cfg["run"].update(steps=1, out_dir=str(tmp_path / "run"), warm_start={"batch_size": 2, "max_steps": 1})
    cfg["env"].update(train_size=20, eval_size=4)
    cfg["loggers"] = []
    path = tmp_path / "single_turn.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path)]) == 2
    assert "rollout.name 'single-turn' cannot lay out" in capsys.readouterr().err
