"""Env ``nemo-gym``: tasks are rows of NeMo Gym datasets (JSONL), scored by NeMo Gym's servers.

A row is what NeMo Gym's rollout collection sends to an agent's ``/run``: its
``responses_create_params`` (the input messages, tools) plus the fields its resources server
verifies against (e.g. ``expected_answer``). The agent server verifies whole trajectories, so
rewards come with the ``nemo-gym`` rollout's samples; this env has no verifier of its own.
``demonstrations()`` pairs each train row with the reference answer in its ``env.demo_field``,
for ``run.warm_start``.
"""
from __future__ import annotations

import json
from collections import deque
from pathlib import Path

from miles import MilesError, Sample, Task

from .config import NemoGymConfig


class NemoGymEnv:
    service = "nemo-gym"  # played by the rollout of the same name (miles.protocols.ServiceEnv)

    def __init__(self, cfg: NemoGymConfig):
        self.cfg = cfg
        self._tasks: dict[str, list[Task]] = {}
        self.failures: deque[str] = deque(maxlen=100)  # reasons of the latest failed trajectories

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            key = "eval_file" if split == "eval" else "train_file"
            self._tasks[split] = load_rows(getattr(self.cfg, key), f"env.{key}", split)
        return self._tasks[split]

    def demonstrations(self) -> list[tuple[Task, str]]:
        """(train task, its row's reference answer) for every train row that has one."""
        key = self.cfg.demo_field
        demos = [(t, text) for t in self.tasks("train") if isinstance(text := t.metadata["row"].get(key), str) and text]
        if not demos:
            raise MilesError(f"env nemo-gym: no row of {self.cfg.train_file} has a {key!r} answer "
                             f"(env.demo_field), so run.warm_start has no demonstrations; remove "
                             f"run.warm_start or set env.demo_field to the rows' reference answer field")
        return demos

    def reward(self, sample: Sample) -> float:
        raise MilesError("env nemo-gym: rewards come from the NeMo Gym agent server with each "
                         "trajectory; set rollout.name: nemo-gym")


def load_rows(path: str, key: str, split: str) -> list[Task]:
    """The rows of a NeMo Gym JSONL file as tasks; a clear error naming ``key`` otherwise."""
    file = Path(path)
    if not file.is_file():
        raise MilesError(f"{key}: {path} is not a file (a JSONL of NeMo Gym rows)")
    tasks = []
    for i, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise MilesError(f"{key}: {path} line {i} is not JSON ({e})") from None
        rcp = row.get("responses_create_params") if isinstance(row, dict) else None
        if not isinstance(rcp, dict) or "input" not in rcp:
            raise MilesError(f"{key}: {path} line {i} has no responses_create_params.input (NeMo Gym's row format)")
        tasks.append(Task(prompt=rcp["input"], label=row.get("expected_answer"), metadata={"row": row},
                          id=str(row.get("id", f"nemo-gym-{split}-{i}"))))
    if not tasks:
        raise MilesError(f"{key}: {path} has no rows")
    return tasks
