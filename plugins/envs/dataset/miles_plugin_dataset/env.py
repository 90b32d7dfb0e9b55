"""The ``dataset`` env: tasks from prompt files, scored by a built-in reward of ``miles_rewards``.

Rows are shuffled by seed, then ``eval_fraction`` of them is held out unless ``eval_files`` are
given. A run visits the training prompts in epochs (``miles.protocols.TrainsInEpochs``): each
epoch every prompt once, in an order shuffled by ``run.seed`` (``shuffle: false``: file order).
With the run's tokenizer (``use_tokenizer``) prompts over ``max_prompt_tokens`` are dropped and
counted. ``reward(sample)`` scores the model's final answer (a multi-turn sample's last turn)
and keeps the reward's own metrics in ``Sample.extensions["dataset"]``; ``metrics(samples)``
averages them into the step's metrics.
"""
from __future__ import annotations

import random
import sys
from typing import Any

from miles import MilesError, Sample, Task

from .config import DatasetConfig
from .loading import load_tasks

KEY = "dataset"
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python",
    "description": "Run a Python program in a sandbox (no network, time and memory limits) and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


class DatasetEnv:
    def __init__(self, cfg: DatasetConfig, seed: int = 0):
        from miles_rewards import RewardConfigError, make_reward

        self.cfg = cfg
        self.shuffle_epochs = cfg.shuffle  # miles.protocols.TrainsInEpochs: unshuffled data keeps file order
        try:
            self.reward_fn = make_reward(cfg.reward, cfg.reward_settings)
        except RewardConfigError as e:
            raise MilesError(f"env.reward_settings: {e}") from None
        rng = random.Random(cfg.data_seed if cfg.data_seed is not None else seed)
        train = load_tasks(cfg.train_files, cfg, "train_files")
        if cfg.shuffle:
            rng.shuffle(train)
        if cfg.eval_files:
            evals = load_tasks(cfg.eval_files, cfg, "eval_files")
            if cfg.shuffle:
                rng.shuffle(evals)
        else:
            held = max(1, round(len(train) * cfg.eval_fraction))
            if held >= len(train):
                raise MilesError(f"env.eval_fraction {cfg.eval_fraction} of {len(train)} training rows leaves none "
                                 f"to train on; add rows, lower it or give env.eval_files")
            evals, train = train[:held], train[held:]
        self.splits = {"train": train, "eval": evals[:cfg.eval_limit] if cfg.eval_limit else evals}
        self.dropped = {"train": 0, "eval": 0}

    # -- the env protocol -------------------------------------------------------------------------
    def tasks(self, split: str) -> list[Task]:
        return self.splits[split]

    def reward(self, sample: Sample) -> float:
        """The built-in reward of the model's final answer (a multi-turn sample's last turn)."""
        from miles_rewards import RewardConfigError

        task = sample.task
        final = sample.extensions.get("multi_turn", {}).get("final_response", sample.response)
        try:
            result = self.reward_fn(final, task.label, task.metadata, prompt=task.prompt)
        except RewardConfigError as e:  # a malformed label or tests column: the row's fault
            raise MilesError(f"{task.id} (file:row): {e}") from None
        sample.extensions[KEY] = {"reward_metrics": result.metrics, "answer": result.answer}
        return result.score

    def answer(self, sample: Sample) -> str | None:
        """The final answer the reward read from ``sample`` (canonical: equal answers are equal
        text), for majority voting; None when it found none or did not score the sample."""
        return sample.extensions.get(KEY, {}).get("answer")

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        """The reward's own metrics (e.g. ``math_extract_failed``) averaged over the samples it scored."""
        from miles_rewards import RewardResult, mean_metrics

        return mean_metrics(RewardResult(0.0, s.extensions[KEY]["reward_metrics"])
                            for s in samples if KEY in s.extensions)

    # -- the run's tokenizer (miles.protocols.UsesTokenizer) ----------------------------------------
    def use_tokenizer(self, tokenizer: Any) -> None:
        """Check chat prompts can be rendered, and drop prompts over ``max_prompt_tokens``."""
        if self.cfg.chat_template and not getattr(tokenizer, "chat_template", None):
            raise MilesError("env.chat_template is true but the model's tokenizer has no chat template; set "
                             "env.chat_template: false to send the prompts as raw text")
        limit = self.cfg.max_prompt_tokens
        if limit is None:
            return
        from miles_tokens import encode_prompts

        for split, tasks in self.splits.items():
            lengths = [len(ids) for ids in encode_prompts(tokenizer, [t.prompt for t in tasks])]
            kept = [t for t, n in zip(tasks, lengths) if n <= limit]
            self.dropped[split] = len(tasks) - len(kept)
            if not kept:
                raise MilesError(f"env.max_prompt_tokens {limit}: every {split} prompt is longer (the shortest has "
                                 f"{min(lengths)} tokens); raise it")
            if self.dropped[split]:
                print(f"env dataset: dropped {self.dropped[split]} of {len(tasks)} {split} prompts longer than "
                      f"env.max_prompt_tokens={limit} tokens", file=sys.stderr)
            self.splits[split] = kept

    # -- tools for the multi_turn rollout (miles.protocols.OffersTools) -----------------------------
    def tools(self) -> list[dict]:
        return [PYTHON_TOOL] if "python" in self.cfg.tools else []

    def call_tool(self, name: str, arguments: dict, task: Task) -> str:
        if name != "python" or "python" not in self.cfg.tools:
            offered = ", ".join(t["function"]["name"] for t in self.tools()) or "none"
            raise ValueError(f"unknown tool {name!r}; tools: {offered}")
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ValueError("code must be a non-empty string")
        from miles_sandbox import run_python

        r = run_python(code, timeout_s=self.cfg.python_timeout_s)
        if r.timed_out:
            raise ValueError(f"timed out after {self.cfg.python_timeout_s:g} s")
        if r.returncode != 0:
            raise ValueError((r.stderr or r.stdout or f"exit code {r.returncode}").strip()[-500:])
        return r.stdout.strip()
