"""The arith env's chat format: "What is 59 + 63? Put the final answer in \\boxed{}." as chat
messages, for a pretrained chat model (its tokenizer's chat template renders them), graded by
the ``regex`` reward of ``miles_rewards`` on the response's final number (``ANSWER``).

The task is to compute, so the answer must be a number: a symbolic grader (the ``math`` reward,
math-verify) evaluates expressions, and a model restating the question ("59 + 63") would score
as right; GRPO finds that within a few steps.

Unlike the plain format it ships no tokenizer (the model's own is used) and no demonstrations:
the model is already a chat model, and RL alone moves it.
"""
from __future__ import annotations

from miles import Sample, Task

from .config import ArithConfig
from .env import split_pairs

KEY = "arith"
# the last number in the response, a \boxed{N} counting as its number; "\boxed{59 + 63}" reads 63
ANSWER = r"\\boxed\{\s*(-?\d+)\s*\}|(-?\d+)"
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithChatEnv:
    def __init__(self, cfg: ArithConfig):
        from miles_rewards import make_reward

        self.cfg = cfg
        self.reward_fn = make_reward("regex", {"pattern": ANSWER})
        pairs = split_pairs(cfg)
        self.splits = {"eval": [self._task(a, b) for a, b in pairs[:cfg.eval_size]],
                       "train": [self._task(a, b) for a, b in pairs[cfg.eval_size:]]}

    def _task(self, a: int, b: int) -> Task:
        op = self.cfg.op
        question = f"What is {a} {op} {b}? {self.cfg.instruction}".strip()
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return Task(prompt=[*system, {"role": "user", "content": question}], label=str(OPS[op](a, b)),
                    metadata={"a": a, "b": b, "op": op}, id=f"{a}{op}{b}")

    def tasks(self, split: str) -> list[Task]:
        return self.splits[split]

    def reward(self, sample: Sample) -> float:
        result = self.reward_fn(sample.response, sample.task.label)
        sample.extensions[KEY] = {"reward_metrics": result.metrics, "answer": result.answer}
        return result.score

    def answer(self, sample: Sample) -> str | None:
        """The final number the reward read, for majority voting; None if there is none."""
        return sample.extensions.get(KEY, {}).get("answer")

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        """The reward's own metrics (``regex_no_match``: no number in the response) over the samples it scored."""
        from miles_rewards import RewardResult, mean_metrics

        return mean_metrics(RewardResult(0.0, s.extensions[KEY]["reward_metrics"])
                            for s in samples if KEY in s.extensions)
