"""Plugins whose answers used to be misread or crash a run: a filter answering "no", a reward of
10**400, a loss without a gradient, and a reward that takes seconds per sample. Each is named,
with the plugin, instead of a silently wrong step or a traceback."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

from miles.cli import main

TINY = str(Path(__file__).resolve().parent / "tiny.yaml")
SMALL = ["run.warm_start=null", "run.threads=1", "run.steps=1", "rollout.batch_size=2", "rollout.n=2",
         "env.eval_size=2"]

SPREAD = """
import itertools

rewards = itertools.cycle([0.0, 1.0])  # groups with a spread, which GRPO trains on


@hookimpl
def miles_reward(sample):
    return next(rewards)
"""


def train(tmp_path: Path, capfd, body: str, *extra: str, spread: bool = False) -> tuple[int, str, Path]:
    plugin = tmp_path / "plugin.py"
    plugin.write_text("from miles import hookimpl\n" + (SPREAD if spread else "") + textwrap.dedent(body))
    out = tmp_path / "run"
    code = main(["train", TINY, f"run.out_dir={out}", *SMALL, "--plugin", str(plugin), *extra])
    o, e = capfd.readouterr()
    return code, " ".join((o + e).split()), out  # the console wraps long lines


def test_a_filter_answering_no_is_an_error_naming_its_plugin(tmp_path, capfd):
    code, text, _ = train(tmp_path, capfd, """
        @hookimpl
        def miles_filter(group):
            return "no"
    """, spread=True)
    assert code == 2 and "Traceback" not in text, text
    assert f"miles_filter of plugin {tmp_path / 'plugin.py'} returned str 'no'" in text, text


def test_a_reward_too_large_for_a_float_is_an_invalid_reward(tmp_path, capfd):
    code, text, out = train(tmp_path, capfd, """
        @hookimpl
        def miles_reward(sample):
            return 10**400
    """)
    assert code == 0 and "Traceback" not in text, text
    assert "not a finite number" in text
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])
    assert row["rewards_invalid"] == 4.0


def test_a_loss_without_grad_is_named(tmp_path, capfd):
    code, text, _ = train(tmp_path, capfd, """
        @hookimpl
        def miles_loss(batch, logprobs):
            return logprobs.detach().mean(), {}
    """, spread=True)
    assert code == 2 and "Traceback" not in text, text
    assert "returned a loss that does not depend on the log-probs" in text and "plugin.py" in text, text


def test_a_slow_reward_is_over_budget_measured_and_warned_about(tmp_path, capfd):
    code, text, out = train(tmp_path, capfd, """
        import time

        @hookimpl
        def miles_reward(sample):
            time.sleep(0.3)
            return 1.0
    """, "rollout.reward_budget=0.2")
    assert code == 0, text
    assert f"plugin {tmp_path / 'plugin.py'} (miles_reward) took 0.3 s" in text, text
    assert text.count("over rollout.reward_budget") == 1  # named once, not per sample
    assert "rewards took" in text and "the reward, not the model, sets the pace" in text, text
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])
    assert step["rewards_over_budget"] == 4.0 and 1.2 <= step["reward_seconds"] < 3.0, step
    assert 0.3 <= step["reward_seconds_max"] < 1.0
