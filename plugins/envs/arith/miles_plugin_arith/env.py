"""Arithmetic tasks, their verifier, a sloppy teacher's demonstrations, a char-level tokenizer.

Prompt ``"07+45="``, answer ``"052"`` (digits+1 characters, zero-padded). The teacher forgets
the carry out of the units column on most carry problems, so supervised training on its
demonstrations plateaus near the share of carry-free problems, while an exact-match reward lets
RL recover the rest.
"""
from __future__ import annotations

import random
from typing import Any

from miles import Sample, Task

from .config import ArithConfig

CHARS = "0123456789+="


def char_tokenizer() -> Any:
    """A Hugging Face fast tokenizer with one token per character of ``CHARS`` (built locally, no
    hub): ``<pad>`` 0, ``<eos>`` 1, then ``0``..``9``, ``+``, ``=`` from 2, no ``<bos>``."""
    from miles_tinypolicy import char_tokenizer as shared

    return shared(CHARS, bos=False)


def split_pairs(cfg: ArithConfig) -> list[tuple[int, int]]:
    """Every operand pair of ``cfg.digits`` digits, shuffled by ``data_seed``: the first
    ``eval_size`` are the held-out problems, the rest the training ones."""
    n = 10 ** cfg.digits
    pairs = [(a, b) for a in range(n) for b in range(n)]
    random.Random(cfg.data_seed).shuffle(pairs)
    if cfg.eval_size >= len(pairs):
        from miles import MilesError
        raise MilesError(f"env.eval_size {cfg.eval_size} leaves no training problems "
                         f"({len(pairs)} exist for digits={cfg.digits}); lower it")
    return pairs


class ArithEnv:
    def __init__(self, cfg: ArithConfig, seed: int = 0):
        self.cfg = cfg
        pairs = split_pairs(cfg)
        self.splits = {"eval": [self._task(a, b) for a, b in pairs[:cfg.eval_size]],
                       "train": [self._task(a, b) for a, b in pairs[cfg.eval_size:]]}
        teacher = random.Random(cfg.data_seed + 1)
        self.demos = [(t, self._teacher(t, teacher)) for t in self.splits["train"]
                      for _ in range(cfg.demos_per_task)]
        self._tok = None
        if cfg.export_dir:  # a dataset file for supervised training from a file (sft's data)
            from .export_data import ensure_exported
            ensure_exported(self, cfg.export_dir)

    def _task(self, a: int, b: int) -> Task:
        d = self.cfg.digits
        return Task(prompt=f"{a:0{d}d}+{b:0{d}d}=", label=f"{a + b:0{d + 1}d}",
                    metadata={"a": a, "b": b, "carry": (a % 10) + (b % 10) >= 10}, id=f"{a}+{b}")

    def _teacher(self, task: Task, rng: random.Random) -> str:
        a, b = task.metadata["a"], task.metadata["b"]
        if task.metadata["carry"] and rng.random() >= self.cfg.teacher_carry_accuracy:
            return f"{a + b - 10:0{self.cfg.digits + 1}d}"  # forgot the carry into the tens
        return task.label

    def tasks(self, split: str) -> list[Task]:
        return self.splits[split]

    def reward(self, sample: Sample) -> float:
        return 1.0 if sample.response.strip() == sample.task.label else 0.0

    def demonstrations(self) -> list[tuple[Task, str]]:
        return self.demos

    def tokenizer(self) -> Any:
        if self._tok is None:
            self._tok = char_tokenizer()
        return self._tok
