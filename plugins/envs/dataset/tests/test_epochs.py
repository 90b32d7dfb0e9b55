"""End to end: a ``dataset`` run visits its training prompts in epochs. Over one epoch's steps,
interrupted by a resume halfway, every prompt is rolled out exactly once; each step logs ``epoch``."""
import json
from collections import Counter

import yaml
from miles.cli import main
from miles_tinypolicy import write_policy

CHARS = "0123456789+=?[]:.abcdefghijklmnopqrstuvwxyz"
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
# records the task of each sample scored, in order (a sync step scores its batch_size x n samples
# together), then lets the env's reward score it
RECORDER = '''from miles import hookimpl


@hookimpl
def miles_reward(sample):
    with open({log!r}, "a") as f:
        f.write(sample.task.id + "\\n")
'''


def test_one_epoch_of_steps_uses_every_prompt_once_across_a_resume(tmp_path):
    write_policy(tmp_path / "policy", CHARS, TEMPLATE, hidden=16, intermediate=32, context=48)
    rows = lambda lo, hi: "".join(json.dumps({"prompt": f"{a}+1=?", "answer": str(a + 1)}) + "\n"  # noqa: E731
                                  for a in range(lo, hi))
    (tmp_path / "train.jsonl").write_text(rows(0, 8))
    (tmp_path / "eval.jsonl").write_text(rows(8, 10))
    log = tmp_path / "scored.txt"
    (tmp_path / "recorder.py").write_text(RECORDER.format(log=str(log)))
    cfg = {"model": {"name": "hf", "path": str(tmp_path / "policy")},
           "env": {"name": "dataset", "train_files": str(tmp_path / "train.jsonl"),
                   "eval_files": str(tmp_path / "eval.jsonl"), "label_key": None, "reward": "regex",
                   "reward_settings": {"pattern": r"^\d"}},
           "rollout": {"batch_size": 2, "n": 2, "max_new_tokens": 2, "temperature": 1.0},
           "algorithm": {"name": "grpo"}, "trainer": {"name": "fsdp2", "lr": 1.0e-3},
           "run": {"steps": 2, "out_dir": str(tmp_path / "run"), "eval_every": 100, "checkpoint_every": 1,
                   "threads": 1, "telemetry": {"enabled": False}}, "loggers": []}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--plugin", str(tmp_path / "recorder.py")]) == 0
    assert main(["train", str(path), "--plugin", str(tmp_path / "recorder.py"), "run.steps=4"]) == 0  # resumes

    train = [task for task in log.read_text().splitlines() if task.startswith("train.jsonl:")]  # not eval's
    per_step = [set(train[i:i + 4]) for i in range(0, len(train), 4)]
    assert len(per_step) == 4 and all(len(tasks) == 2 for tasks in per_step)  # batch_size prompts a step
    assert Counter(t for tasks in per_step for t in tasks) == Counter(f"train.jsonl:{i}" for i in range(1, 9))
    assert Counter(train) == Counter({f"train.jsonl:{i}": 2 for i in range(1, 9)})  # n samples each

    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m.get("epoch")) for m in metrics] == [(0, None), (1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]
