"""End to end on a tiny chat policy: ``miles train`` with ``env.name: dataset``, then ``miles eval
--show`` with pass@k and maj@k, the multi-turn rollout, and a miles_reward plugin overriding the
built-in reward."""
import json
import subprocess
import sys

import pytest
import yaml
from miles.cli import main
from miles_tinypolicy import write_policy

CHARS = "0123456789+=?[]:.abcdefghijklmnopqrstuvwxyz"
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step GRPO run: 1-digit sums, rewarded for answering with a digit (regex, no label), so
    a random policy's groups have reward variance and the steps really update."""
    base = tmp_path_factory.mktemp("dataset")
    write_policy(base / "policy", CHARS, TEMPLATE, hidden=32, intermediate=64, context=64)
    rows = [{"prompt": f"{a}+{b}=?", "answer": str(a + b), "level": a % 3} for a in range(10) for b in range(10)]
    (base / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"name": "hf", "path": str(base / "policy")},
           "env": {"name": "dataset", "train_files": str(base / "train.jsonl"), "eval_fraction": 0.1,
                   "label_key": None, "reward": "regex", "reward_settings": {"pattern": r"^\d"},
                   "max_prompt_tokens": 40},
           "rollout": {"batch_size": 8, "n": 4, "max_new_tokens": 4, "temperature": 1.0},
           "algorithm": {"name": "grpo"}, "trainer": {"name": "fsdp2", "lr": 1.0e-3},
           "run": {"steps": 3, "out_dir": str(base / "run"), "eval_every": 3, "threads": 1}, "loggers": []}
    path = base / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "miles.cli", "train", str(path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return path, [json.loads(line) for line in (base / "run" / "metrics.jsonl").read_text().splitlines()]


def test_train_logs_the_rewards_metrics(trained):
    _, rows = trained
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[-1] and "eval_regex_no_match" in rows[0]
    steps = rows[1:]
    assert all(0.0 <= r["regex_no_match"] <= 1.0 and r["reward_mean"] == pytest.approx(1 - r["regex_no_match"])
               for r in steps)
    assert sum(r["groups_kept"] for r in steps) > 0 and rows[-1]["weight_version"] > 0  # real updates


def test_eval_prints_pass_at_k_majority_and_shown_samples(trained, capsys):
    path, _ = trained
    assert main(["eval", str(path), "--samples", "4", "--k", "1", "--k", "2", "--show", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    got = json.loads(out[-1])
    assert got["step"] == 3 and got["prompts"] == 10 and got["samples"] == 4 and got["temperature"] == 1.0
    assert got["pass@1"] == pytest.approx(got["eval_accuracy"]) and got["pass@2"] >= got["pass@1"]
    assert 0.0 <= got["maj@2"] <= 1.0 and "eval_regex_no_match" in got
    text = "\n".join(out[:-1])
    assert text.count("--- prompt ") == 2 and text.count("response ") == 8 and "[user]" in text
    assert main(["eval", str(path), "--samples", "2", "--k", "3"]) == 2  # k > samples: a usage error
    assert "--k 3 must be between 1 and --samples (2)" in capsys.readouterr().err


def test_eval_with_the_multi_turn_rollout_and_a_reward_plugin(trained, capsys, tmp_path):
    path, _ = trained
    assert main(["eval", str(path), "rollout.name=multi_turn", "rollout.max_total_tokens=48", "env.tools=[python]",
                 "--limit", "3"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["prompts"] == 3 and "eval_turns_mean" in got and "eval_regex_no_match" in got
    plugin = tmp_path / "always.py"
    plugin.write_text("from miles import hookimpl\n\n\n@hookimpl\ndef miles_reward(sample):\n    return 1.0\n")
    assert main(["eval", str(path), "--plugin", str(plugin), "--limit", "3"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["eval_accuracy"] == 1.0 and "eval_regex_no_match" not in got  # the env's reward never ran
