"""The default run mode, ``run.mode: sync``: roll out, train, push the new weights, in that order,
with nothing running between steps. Other modes (``async``) are plugins."""
from __future__ import annotations

import contextlib
import random
import time
from typing import Any

from .errors import EngineRestarted
from .types import Group, SamplingParams


class SyncMode:
    """Roll out, train, push the new weights, in that order: every sample is exactly on-policy.
    Every call happens on the trainer's thread (see ``miles.protocols.Mode``)."""

    def __init__(self, cfg: Any = None, *, ctx: Any) -> None:
        self.ctx = ctx  # miles.rollouts.ModeContext

    def take(self, rng: random.Random, params: SamplingParams) -> tuple[list[Group], dict[str, Any]]:
        """Roll out until ``rollout.batch_size`` groups pass the filters (bounded refill:
        ``rollout.oversample_rounds`` extra rounds at most, so a step never hangs)."""
        ctx, r, t0 = self.ctx, self.ctx.rollout, time.perf_counter()
        kept, sampled, dropped, mark = [], [], 0, ctx.order.consumed
        for _ in range(r.oversample_rounds + 1):
            tasks = ctx.order.draw(rng, r.batch_size - len(kept))  # random, or the next ones in epoch order
            try:
                groups = ctx.rollouts.run(tasks, r.n, params)
            except EngineRestarted:
                ctx.order.consumed = mark  # the take is asked again: it redraws the same epoch slice
                raise
            sampled += groups
            for g in groups:
                if ctx.rollouts.keep(g):
                    kept.append(g)
                else:
                    dropped += 1
            if len(kept) >= r.batch_size:
                break
        t_roll = time.perf_counter()
        samples = [s for g in sampled for s in g.samples]
        return kept, {
            "reward_mean": sum(s.reward for s in samples) / len(samples), "staleness_mean": 0.0,
            "groups_kept": len(kept), "groups_dropped": dropped,
            "response_length_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "tokens_per_second": sum(len(s.response_ids) for s in samples) / max(t_roll - t0, 1e-9),
            "rollout_seconds": t_roll - t0, **ctx.rollouts.metrics(samples), **ctx.order.metrics()}

    def push(self, source: Any, engines: list, version: int, wait: bool = True) -> dict[str, float]:
        return self.ctx.transport.sync(source, engines, version)

    def finish_push(self) -> dict[str, float]:
        return {}

    def reweight(self, batch: Any, logprobs: Any) -> tuple[Any, dict[str, float]]:
        return batch, {}

    def lock_engines(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass
