"""pass@k and maj@k estimators, and ``miles eval`` sampling on the arith and tool-use envs (fresh
models: the figures are checked for consistency, not for skill)."""
import json
from math import comb
from pathlib import Path

import pytest
from miles.cli import main
from miles_plugin_eval.scoring import majority_at_k, pass_at_k, summarize

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize("n,c,k", [(10, 3, 1), (10, 3, 5), (20, 0, 4), (5, 5, 2), (200, 7, 50), (4, 1, 4)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_majority_voting_over_disjoint_chunks():
    # chunk 1: '7' twice (right) beats '8'; chunk 2: '8' twice (wrong) beats '7'; unanswered samples don't vote
    answers = ["7", "8", "7", None, "8", "8", "7", None]
    correct = [a == "7" for a in answers]
    assert majority_at_k(answers, correct, 4) == 0.5
    assert majority_at_k([None, None], [False, False], 2) == 0.0
    assert majority_at_k(["a", "b"], [False, True], 2) == 0.0  # a tie goes to the first answer seen
    got = summarize([(answers, correct), (["1"] * 8, [True] * 8)], [1, 4])
    assert got["pass@1"] == pytest.approx((3 / 8 + 1) / 2) and got["maj@4"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="k=3 must be between 1"):
        pass_at_k(2, 1, 3)


@pytest.mark.parametrize("config,overrides", [
    ("tests/tiny.yaml", []),
    ("recipes/tool_use.yaml", ["env.train_size=20", "env.eval_size=6", "rollout.max_total_tokens=64"]),
])
def test_eval_samples_the_arith_and_tool_use_envs(config, overrides, tmp_path, capsys):
    args = ["eval", str(ROOT / config), f"run.out_dir={tmp_path / 'run'}", "loggers=[]", "rollout.temperature=1.0",
            *overrides, "--samples", "3", "--k", "2", "--limit", "6", "--show", "1", "--untrained"]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    got = json.loads(out[-1])
    assert got["step"] is None and got["prompts"] == 6 and got["samples"] == 3
    assert got["pass@2"] >= got["pass@1"] == pytest.approx(got["eval_accuracy"]) and "maj@2" in got
    assert got["rollout_seconds"] > 0 and got["generated_tokens_per_s"] > 0  # the model's tokens over that time
    assert sum(line.startswith("--- prompt 1/1") for line in out) == 1
    assert sum(line.startswith("response ") for line in out) == 3
