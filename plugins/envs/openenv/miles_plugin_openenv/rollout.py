"""Rollout ``openenv``: multi-step episodes on an OpenEnv server as one token sequence per sample.

Each sample is one episode in its own WebSocket session: reset with the task's seed, then per
turn the engine generates (its own token ids and log-probs kept), the decoded text is the
action's ``step``, and the observation's feedback text is appended as tokens with loss_mask 0
and log-prob 0.0, until the server says done or ``max_turns`` is reached. The sample's reward
is the sum of the episode's step rewards. An episode whose server fails (down, timeout,
malformed answer) becomes a ``Status.FAILED`` sample with loss_mask zeroed. The engine's
``Completion.extras`` (e.g. ``{"moe": {"routed_experts": ...}}``) reach ``Sample.extensions``
from the episode's last turn, whose records span the whole sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from miles import MilesError, Sample, SamplingParams, Task
from miles.protocols import ServiceEnv
from miles.types import Status

from .client import EnvServerError, field_text
from .config import OpenEnvRolloutConfig


@dataclass
class _Episode:
    task: Task
    prompt_ids: list[int]
    client: Any = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    extras: dict = field(default_factory=dict)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    status: Status = Status.COMPLETED
    error: str = ""


class OpenEnvRollout:
    def __init__(self, cfg: OpenEnvRolloutConfig):
        self.cfg = cfg

    def generate(self, tasks: Sequence[Task], n: int, *, engine: Any, env: Any, tokenizer: Any,
                 params: SamplingParams) -> list[list[Sample]]:
        if not (isinstance(env, ServiceEnv) and env.service == "openenv"):
            raise MilesError("rollout.name: openenv plays episodes on the openenv env's server: "
                             "set env.name: openenv")
        from miles_tokens import encode_prompts

        prompt_ids = encode_prompts(tokenizer, [t.prompt for t in tasks])
        eps = [_Episode(t, list(p)) for t, p in zip(tasks, prompt_ids) for _ in range(n)]
        try:
            clients = env.sessions.open(len(eps))
        except EnvServerError as e:
            raise MilesError(f"rollout openenv: {e}") from e
        try:
            for ep, c in zip(eps, clients):
                ep.client = c
            self._answer(eps, env.sessions.call_all([(e.client, "reset", e.task.metadata["seed"]) for e in eps]),
                         env, tokenizer, reset=True)
            for _ in range(self.cfg.max_turns):
                live = [e for e in eps if not e.done]
                if not live:
                    break
                self._turn(live, engine, env, tokenizer, params)
        finally:
            env.sessions.close(clients)
        env.failures.extend(e.error for e in eps if e.error)
        return [[self._sample(e, tokenizer) for e in eps[i * n:(i + 1) * n]] for i in range(len(tasks))]

    def _turn(self, live: list[_Episode], engine: Any, env: Any, tokenizer: Any, params: SamplingParams) -> None:
        outs = engine.generate([e.prompt_ids + e.ids for e in live], params, n=1)
        texts = [tokenizer.decode(o[0].token_ids, skip_special_tokens=True) for o in outs]
        for e, o in zip(live, outs):
            c = o[0]
            e.ids += c.token_ids
            e.logprobs += c.logprobs
            e.mask += [1] * len(c.token_ids)
            e.versions += c.weight_versions or [c.weight_version]
            # each turn's prompt is the whole episode so far, so the latest turn's per-token
            # records (e.g. an MoE model's routed experts) cover every earlier turn too
            e.extras.update(c.extras)
            e.turns += 1
            e.status = Status.COMPLETED if c.finish_reason == "stop" else Status.TRUNCATED
        act = env.cfg.action_field
        answers = env.sessions.call_all([(e.client, "step", {act: t}) for e, t in zip(live, texts)])
        self._answer(live, answers, env, tokenizer, reset=False)

    def _answer(self, eps: list[_Episode], answers: list[Any], env: Any, tokenizer: Any, reset: bool) -> None:
        for e, a in zip(eps, answers):
            if isinstance(a, Exception):
                e.done, e.status, e.error = True, Status.FAILED, f"{type(a).__name__}: {a}"
                continue
            if not reset:
                e.reward += a.reward or 0.0
            if a.done:
                e.done = True
                continue
            if not reset:  # the feedback is shown to the model before its next turn, never trained on
                text = field_text(a.observation, env.cfg.feedback_field, "feedback_field") + self.cfg.turn_separator
                fb = list(tokenizer.encode(text, add_special_tokens=False))
                e.ids += fb
                e.logprobs += [0.0] * len(fb)
                e.mask += [0] * len(fb)

    @staticmethod
    def _sample(e: _Episode, tokenizer: Any) -> Sample:
        failed = e.status == Status.FAILED
        return Sample(task=e.task, prompt_ids=e.prompt_ids, response_ids=e.ids,
                      response=tokenizer.decode(e.ids, skip_special_tokens=True), logprobs=e.logprobs,
                      loss_mask=[0] * len(e.mask) if failed else e.mask, reward=0.0 if failed else e.reward,
                      status=e.status, weight_version=min(e.versions, default=0),
                      weight_versions=e.versions,
                      extensions={**e.extras, "openenv": {"turns": e.turns, "error": e.error}})

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        eps = [s.extensions.get("openenv", {}) for s in samples]
        if not eps:
            return {}
        return {"turns_mean": sum(e.get("turns", 0) for e in eps) / len(eps),
                "env_failed": float(sum(bool(e.get("error")) for e in eps))}
