"""Env ``harbor``: tasks are Harbor task folders; trials (and their rewards) run on the server.

A task folder holds ``task.toml``, ``instruction.md`` (the prompt), ``environment/`` (the
container the agent works in) and ``tests/`` (the verifier that writes the reward). The server
runs the trials, so rewards come with the ``harbor`` rollout's samples.
"""
from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

from miles import MilesError, Sample, Task

from .config import HarborConfig


class HarborEnv:
    service = "harbor"  # played by the rollout of the same name (miles.protocols.ServiceEnv)

    def __init__(self, cfg: HarborConfig):
        self.cfg = cfg
        self._tasks: dict[str, list[Task]] = {}
        self.failures: deque[str] = deque(maxlen=100)  # reasons of the latest failed trials
        self._tok = None

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            key = "eval_tasks_dir" if split == "eval" else "tasks_dir"
            self._tasks[split] = task_folders(getattr(self.cfg, key), f"env.{key}")
        return self._tasks[split]

    def reward(self, sample: Sample) -> float:
        raise MilesError("env harbor: rewards come from the Harbor server's verifier with each "
                         "trial; set rollout.name: harbor")

    def tokenizer(self) -> Any:
        if self._tok is None:
            from miles_tinypolicy import char_tokenizer

            self._tok = char_tokenizer(self.cfg.chars)
        return self._tok


def task_folders(path: str, key: str) -> list[Task]:
    """One task per subfolder with a ``task.toml``; the prompt is its ``instruction.md``."""
    root = Path(path)
    if not root.is_dir():
        raise MilesError(f"{key}: {path} is not a folder of Harbor tasks")
    tasks = []
    for folder in sorted(p for p in root.iterdir() if (p / "task.toml").is_file()):
        instruction = folder / "instruction.md"
        prompt = instruction.read_text() if instruction.is_file() else ""
        tasks.append(Task(prompt=prompt, metadata={"path": str(folder.resolve()), "name": folder.name},
                          id=f"harbor-{folder.name}"))
    if not tasks:
        raise MilesError(f"{key}: {path} has no task folders (subfolders with a task.toml)")
    return tasks
