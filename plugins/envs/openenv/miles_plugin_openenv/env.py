"""Env ``openenv``: tasks are episodes of an OpenEnv server, reset with fixed seeds.

``tasks(split)`` resets one session per seed and keeps the prompt each reset shows;
``demonstrations()`` pairs each train task with the reference answer its reset showed (for
``run.warm_start``, when the server provides one). ``reward(sample)`` replays a single-turn
answer in a fresh episode (reset with the task's seed, one ``step``) and returns the server's
reward. Multi-step episodes go through the ``openenv`` rollout, which sets the reward itself.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any

from miles import MilesError, Sample, Task

from .client import EnvServerError, Sessions, field_text
from .config import OpenEnvConfig

EVAL_SEED0 = 1_000_000
RESET_CHUNK = 16  # sessions opened at once while listing tasks (servers cap concurrent sessions)


class OpenEnvEnv:
    service = "openenv"  # played by the rollout of the same name (miles.protocols.ServiceEnv)

    def __init__(self, cfg: OpenEnvConfig):
        self.cfg = cfg
        self.sessions = Sessions(cfg.base_url, cfg.connect_timeout_s, cfg.message_timeout_s)
        self._tasks: dict[str, list[Task]] = {}
        self._tok = None
        self.failures: deque[str] = deque(maxlen=100)  # reasons of the latest failed episodes

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            count, seed0 = (self.cfg.eval_seeds, EVAL_SEED0) if split == "eval" else (self.cfg.train_seeds, 0)
            self._tasks[split] = self._list(range(seed0, seed0 + count))
        return self._tasks[split]

    def _list(self, seeds: range) -> list[Task]:
        out: list[Task] = []
        for i in range(0, len(seeds), RESET_CHUNK):
            chunk = list(seeds[i:i + RESET_CHUNK])
            clients = self.sessions.open(len(chunk))
            try:
                answers = self.sessions.call_all([(c, "reset", s) for c, s in zip(clients, chunk)])
            finally:
                self.sessions.close(clients)
            for seed, a in zip(chunk, answers):
                if isinstance(a, Exception):
                    raise MilesError(f"env openenv: reset(seed={seed}) at {self.cfg.base_url} failed: {a}")
                prompt = field_text(a.observation, self.cfg.prompt_field, "prompt_field")
                meta = {"seed": seed}
                ref = a.observation.get(self.cfg.reference_field)
                if isinstance(ref, str) and ref:
                    meta["reference"] = ref
                out.append(Task(prompt=prompt, metadata=meta, id=f"openenv-{seed}"))
        return out

    def demonstrations(self) -> list[tuple[Task, str]]:
        """(train task, the reference answer its reset observation showed), for ``run.warm_start``."""
        demos = [(t, t.metadata["reference"]) for t in self.tasks("train") if "reference" in t.metadata]
        if not demos:
            raise MilesError(f"env openenv: the server at {self.cfg.base_url} shows no reference answers "
                             f"(observation field {self.cfg.reference_field!r}, env.reference_field), so "
                             f"run.warm_start has no demonstrations; remove run.warm_start")
        return demos

    def play_single_turn(self, samples: list[Sample]) -> list[float]:
        """One fresh episode per sample: reset with its task's seed, step with its response. A
        failed episode scores NaN, which the kernel turns into a failed, untrained sample."""
        clients = self.sessions.open(len(samples))
        try:
            resets = self.sessions.call_all([(c, "reset", s.task.metadata["seed"]) for c, s in zip(clients, samples)])
            act = self.cfg.action_field
            steps = self.sessions.call_all([(c, "step", {act: s.response}) for c, s, r in
                                            zip(clients, samples, resets) if not isinstance(r, Exception)])
        finally:
            self.sessions.close(clients)
        it, out = iter(steps), []
        for r in resets:
            a = r if isinstance(r, Exception) else next(it)
            if isinstance(a, Exception):
                self.failures.append(str(a))
                out.append(math.nan)
            else:
                out.append(a.reward if a.reward is not None else 0.0)
        return out

    def reward(self, sample: Sample) -> float:
        try:
            return self.play_single_turn([sample])[0]
        except EnvServerError as e:
            self.failures.append(str(e))
            return math.nan

    def tokenizer(self) -> Any:
        if self._tok is None:
            from miles_tinypolicy import char_tokenizer

            self._tok = char_tokenizer(self.cfg.chars)
        return self._tok
