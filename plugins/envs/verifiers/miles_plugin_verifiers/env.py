"""Env ``verifiers``: the tasks of the worker's verifiers taskset.

Train tasks are the taskset's rows ``0..train_size-1``, eval tasks the ``eval_size`` rows after
them. Rewards come from the verifiers rollout (``rollout.name: verifiers``), which plays each
episode in the worker and returns the task's own score.
"""
from __future__ import annotations

from typing import Any

from miles import MilesError, Sample, Task

from .client import WorkerClient, WorkerError
from .config import VerifiersConfig


class VerifiersEnv:
    service = "verifiers"  # played by the rollout of the same name (miles.protocols.ServiceEnv)

    def __init__(self, cfg: VerifiersConfig):
        self.cfg = cfg
        self.worker = WorkerClient(cfg.worker_url, cfg.connect_timeout_s, cfg.timeout_s + cfg.reply_grace_s)
        self._tasks: dict[str, list[Task]] = {}
        self._tok = None

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            start, count = (self.cfg.train_size, self.cfg.eval_size) if split == "eval" else (0, self.cfg.train_size)
            try:
                rows = self.worker.call("/tasks", {"start": start, "count": count}).get("tasks")
            except WorkerError as e:
                raise MilesError(f"env verifiers: listing the {split} tasks: {e}") from e
            if not isinstance(rows, list) or len(rows) != count or not all(
                    isinstance(r, dict) and isinstance(r.get("prompt"), str) for r in rows):
                raise MilesError(f"env verifiers: the worker at {self.cfg.worker_url} answered /tasks with "
                                 f"{str(rows)[:200]}; expected {count} rows with a text prompt")
            self._tasks[split] = [Task(prompt=r["prompt"], metadata={"idx": int(r["idx"]), "vf_id": r.get("id")},
                                       id=f"verifiers-{r['idx']}") for r in rows]
        return self._tasks[split]

    def reward(self, sample: Sample) -> float:
        raise MilesError("env verifiers scores whole episodes in its worker: set rollout.name: verifiers")

    def tokenizer(self) -> Any:
        if self._tok is None:
            from .policy import chat_tokenizer

            self._tok = chat_tokenizer(self.cfg.chars)
        return self._tok
