"""Rank 0's rollout service (tasks -> rewarded groups), the narrow view a run mode gets, and the
default rollout ``single_turn`` (one generation per sample). Other rollouts (``multi_turn``) are
plugins."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from miles_tokens import decode_batch, encode_prompts

from .errors import MilesError
from .rewardclock import RewardClock
from .taskorder import TaskOrder
from .types import Group, SamplingParams, Sample, Status, Task


class RolloutService:
    """Generates groups: custom ``miles_rollout`` hooks first, every task nobody claims in one
    call of the ``rollout.name`` component; then rewards (``miles_reward``, else a reward the
    rollout set, else the env's verifier). A reward that is not a finite number excludes its
    sample from training (``loss_mask`` zeroed, ``Status.FAILED``) and is reported once per source."""

    def __init__(self, pm: Any, rollout: Any, engine: Any, env: Any, tokenizer: Any, algorithm: Any,
                 console: Callable[[str], None] = print, recorder: Any = None,
                 reward_budget: float = 10.0) -> None:
        self.pm, self.rollout, self.engine, self.env = pm, rollout, engine, env
        self.recorder = recorder  # miles.protocols.Recorder: generate, reward and filter spans
        self.tokenizer, self.algorithm, self.console = tokenizer, algorithm, console
        # the plugin of the default rollout (single_turn) also gives miles_rollout's trylast default,
        # for callers outside a run; a run batches the tasks no hook claims into its own component
        default, impls = pm.registry("rollouts").get("single-turn"), pm.hook.miles_rollout.get_hookimpls()
        own = [i.plugin for i in impls if default is not None and pm.describe(i.plugin) == default.plugin]
        custom = len(impls) > len(own)
        self._custom = pm.subset_hook_caller("miles_rollout", remove_plugins=own) if custom else None
        self._reported: set[str] = set()
        self.invalid_rewards = 0
        self.clock = RewardClock(reward_budget, console)  # reward time against rollout.reward_budget

    def run(self, tasks: list[Task], n: int, params: SamplingParams) -> list[Group]:
        out: dict[int, list[Sample]] = {}
        ctx = {"engine": self.engine, "env": self.env, "tokenizer": self.tokenizer, "params": params}
        with self._span("generate") as span:
            if self._custom is not None:
                for i, task in enumerate(tasks):
                    samples = self._custom(task=task, n=n, **ctx)
                    if samples is not None:
                        out[i] = samples
            pending = [i for i in range(len(tasks)) if i not in out]
            if pending:
                out.update(zip(pending, self.rollout.generate([tasks[i] for i in pending], n, **ctx)))
            span["tokens"] = sum(len(s.response_ids) for ss in out.values() for s in ss)
        groups = [Group(t, out[i]) for i, t in enumerate(tasks)]
        with self._span("reward"):
            for sample in (s for g in groups for s in g.samples):
                self.score(sample)
        return groups

    def _span(self, name: str) -> Any:
        """A timed span of the run's recorder; its value is a dict of attributes to fill in."""
        return self.recorder.span(name) if self.recorder is not None else contextlib.nullcontext({})

    def keep(self, group: Group) -> bool:
        """The algorithm's own filter and every ``miles_filter`` (any ``False`` drops the group);
        an answer that is not True, False or None is an error naming its plugin, since reading
        "no" as a vote to keep would train on groups the user meant to drop."""
        with self._span("filter"):
            if not self.algorithm.keep(group):
                return False
            votes = self.pm.hook.miles_filter(group=group)
            if any(not isinstance(v, bool) and type(v).__name__ != "bool_" for v in votes):
                raise MilesError(_bad_filter(self.pm, group))
            return False not in votes

    def score(self, s: Sample) -> None:
        t0 = time.perf_counter()
        r, source = first_reward(self.pm, s)
        if r is None and s.reward is not None:
            r, source = s.reward, "the rollout"
        elif r is None:
            r, source = self.env.reward(s), "the env's verifier"
        self.clock.record(source, time.perf_counter() - t0)
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not _finite(r):
            self.invalid_rewards += 1
            if source not in self._reported:
                self._reported.add(source)
                self.console(f"warning: {source} returned the reward {r!r} (not a finite number); "
                             f"such samples are excluded from training (metric rewards_invalid)")
            s.reward, s.status, s.loss_mask = 0.0, Status.FAILED, [0] * len(s.loss_mask or [])
            return
        s.reward = float(r)

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        """The rollout component's and the env's own step metrics (e.g. ``turns_mean``), if any."""
        from .protocols import EngineStepMetrics, EnvMetrics, RolloutMetrics

        m = self.rollout.metrics(samples) if isinstance(self.rollout, RolloutMetrics) else {}
        if isinstance(self.env, EnvMetrics):  # e.g. the verifier's extraction failures
            m = {**m, **self.env.metrics(samples)}
        if isinstance(self.engine, EngineStepMetrics):  # e.g. speculative decoding's acceptance
            m = {**m, **self.engine.step_metrics()}
        count, self.invalid_rewards = self.invalid_rewards, 0
        m = {**m, **self.clock.metrics()}
        return {**m, "rewards_invalid": float(count)} if count else dict(m)


def _finite(r: float) -> bool:
    """Whether ``r`` is a finite float; an int too large for a float (10**400) is not."""
    try:
        return math.isfinite(r)
    except OverflowError:
        return False


def _bad_filter(pm: Any, group: Group) -> str:
    """Which ``miles_filter`` gave a non-bool answer, asked one by one on this error path only."""
    for impl in pm.hook.miles_filter.get_hookimpls():
        if impl.wrapper or impl.hookwrapper:
            continue
        v = impl.function(*[{"group": group}[a] for a in impl.argnames])
        if v is not None and not isinstance(v, bool) and type(v).__name__ != "bool_":
            return (f"miles_filter of plugin {pm.describe(impl.plugin)} returned {type(v).__name__} {v!r:.40}; "
                    f"it must return True (keep the group), False (drop it) or None (no opinion)")
    return "a miles_filter returned an answer that is not True, False or None"


def first_reward(pm: Any, s: Sample) -> tuple[Any, str]:
    """``miles_reward``'s answer for ``s`` and who gave it, each implementation called at most once
    (a remote judge is never asked twice): plain implementations in pluggy's firstresult order
    (``get_hookimpls()`` reversed, so ``tryfirst`` and later registrations first), each with the
    arguments it takes. Wrappers need pluggy's own call, which does not say who answered."""
    impls = pm.hook.miles_reward.get_hookimpls()
    if any(i.wrapper or i.hookwrapper for i in impls):
        names = ", ".join(pm.describe(i.plugin) for i in impls)
        return pm.hook.miles_reward(sample=s), f"a miles_reward plugin (one of {names})"
    for impl in reversed(impls):
        r = impl.function(*[{"sample": s}[a] for a in impl.argnames])
        if r is not None:
            return r, f"plugin {pm.describe(impl.plugin)} (miles_reward)"
    return None, ""


@dataclass
class ModeContext:
    """What a run mode (``miles.protocols.Mode``) receives: no loop, only what it uses.
    ``rollouts`` (the ``Rollouts`` service) and ``engines`` exist on trainer rank 0 only.
    ``order``: where the steps draw their ``train_tasks`` from (``order.draw(rng, k)``; random
    samples unless the env trains in epochs), and its ``metrics()`` for each step."""

    settings: Any  # the mode's own schema's settings (from the rollout section), or None
    rollout: Any  # the kernel's RolloutConfig: batch_size, n, oversample_rounds, ...
    rollouts: RolloutService | None
    transport: Any
    engines: list[Any]
    train_tasks: list[Task]
    params: SamplingParams
    seed: int
    uses_rollout: bool
    remote: bool  # the engines run in other processes (they serialise requests and updates)
    version_fn: Callable[[], int] = field(repr=False, default=lambda: 0)
    console: Callable[[str], None] = field(repr=False, default=print)
    order: TaskOrder | None = field(repr=False, default=None)  # None: random samples of train_tasks

    def __post_init__(self) -> None:
        if self.order is None:
            self.order = TaskOrder(self.train_tasks, self.seed)

    @property
    def version(self) -> int:
        """The trainer's current weight version (it moves while a mode's workers run)."""
        return self.version_fn()


def single_turn(tasks: list[Task], n: int, engine: Any, tokenizer: Any, params: SamplingParams) -> list[list[Sample]]:
    """Generate ``n`` samples for each task in one batched engine call. A completion that ended
    on a stop token is ``completed``, one cut by ``max_new_tokens`` ``truncated``; the engine's
    per-completion extras (e.g. routed experts) go to ``Sample.extensions``."""
    prompts = encode_prompts(tokenizer, [t.prompt for t in tasks])
    outs = engine.generate(prompts, params, n=n)
    texts = iter(decode_batch(tokenizer, [c.token_ids for cs in outs for c in cs]))
    return [[Sample(task=task, prompt_ids=prompt_ids, response_ids=c.token_ids, response=next(texts),
                    logprobs=c.logprobs, weight_version=c.weight_version,
                    weight_versions=c.weight_versions or [c.weight_version],
                    extensions=dict(c.extras),
                    status=Status.COMPLETED if c.finish_reason == "stop" else Status.TRUNCATED)
             for c in completions]
            for task, prompt_ids, completions in zip(tasks, prompts, outs)]


class SingleTurn:
    """``rollout.name: single_turn`` (``miles.protocols.Rollout``): one generation per sample,
    all tasks in one engine call."""

    def __init__(self, cfg: Any = None, **_: Any) -> None:
        pass

    def generate(self, tasks: list[Task], n: int, *, engine: Any, env: Any, tokenizer: Any,
                 params: SamplingParams) -> list[list[Sample]]:
        return single_turn(tasks, n, engine, tokenizer, params)
