"""The rollout workers of ``run.mode: async``: producer threads that keep requests in flight at
the engines and put finished groups into a bounded buffer, paced so that no group is generated
that would be more than ``rollout.max_staleness`` weight versions old when the trainer takes it;
and the trainer's side, ``take``. Groups that still are (the trainer slowed down) are dropped or
kept (``rollout.stale_policy``); a sample's age is that of its oldest tokens
(``Sample.weight_version``).
"""
from __future__ import annotations

import contextlib
import math
import queue
import random
import threading
import time
from dataclasses import replace
from typing import Any

from miles import EngineRestarted, Group, MilesError

# pacing: groups generated beyond the expected need (the share the filters drop varies), and
# beyond what a take still lacks (a few groups may all be filtered out)
MARGIN, EXTRA = 0.1, 2


class Streamer:
    """Producer threads (each keeps one request of up to ``batch_size`` prompts in flight at
    the engines) plus the trainer-side ``take``. An in-process engine is shared under a lock, so
    a weight update waits for the chunk being generated (it finishes on the old weights); remote
    engines serialise requests and updates themselves.

    Pacing: a producer starts a chunk only when its groups will be at most ``max_staleness``
    versions old when the trainer takes them. They queue behind the buffer and the chunks in
    flight, and the trainer takes about ``batch_size x sampled_per_kept`` groups a step, so their
    position says at which version they are taken; the engines' version is the last push that
    landed. Groups the trainer would drop as stale are not generated: the cores they would have
    cost go to the trainer (a producer that waits counts as ``engine_idle_seconds``)."""

    def __init__(self, cfg: Any, ctx: Any, lock: Any):
        # cfg: AsyncConfig; ctx: miles.rollouts.ModeContext; lock: held around each engine call
        self.cfg, self.ctx, r = cfg, ctx, ctx.rollout
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.buffer: queue.Queue[Group] = queue.Queue(maxsize=cfg.buffer_groups or 2 * r.batch_size)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.restarted: EngineRestarted | None = None  # set by a worker, cleared after a re-sync
        self.resynced = threading.Event()
        self.partial: tuple[list, list, dict[str, float]] = ([], [], {})  # take() state across retries
        self.blocked = [0.0] * cfg.async_workers  # seconds each worker waited (pacing, full buffer)
        self.idle_mark = 0.0
        self.chunk = r.batch_size  # prompts per request at most: pacing sizes each one
        self.cv = threading.Condition()  # guards the pacing state below
        self.engine_version = ctx.version  # the weights the engines hold: the last push that landed
        self.taking = False  # the trainer is in take()
        self.need = 0  # kept groups the take in progress still needs
        self.taken_at: int | None = None  # ctx.version at the last completed take
        self.in_flight = 0  # groups requested from the engines and not in the buffer yet
        self.waiting = 0  # producers waiting for room
        self.per_kept: float | None = None  # groups sampled per group kept (filters), recent takes
        self.threads = [threading.Thread(target=self._produce, args=(i,), daemon=True,
                                         name=f"miles-rollout-{i}") for i in range(cfg.async_workers)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        self.wake()
        with contextlib.suppress(queue.Empty):
            while True:
                self.buffer.get_nowait()
        for t in self.threads:
            t.join(timeout=30)

    def wake(self, landed: int | None = None) -> None:
        """The pacing state changed (a push landed: ``landed`` is its version; a new version;
        the trainer took groups)."""
        with self.cv:
            if landed is not None:
                self.engine_version = max(self.engine_version, landed)
            self.cv.notify_all()

    def _room(self) -> float:
        """Between takes: how many groups, counted from the trainer's next one, are still at
        most ``max_staleness`` versions old when taken if generated now. Called under ``cv``."""
        version = self.ctx.version
        per_step = self.ctx.rollout.batch_size * (self.per_kept or 1.0) * (1 + MARGIN)  # what a take takes
        # the step that took last has not bumped the version yet
        next_version = version + (self.taken_at == version)
        return max(0, self.cfg.max_staleness + self.engine_version - next_version + 1) * per_step

    def _chunk_size(self) -> int:
        """Prompts the next chunk may have (0: wait). Called under ``cv``. A take waiting for
        more than is queued gets what it lacks at once, and a little more (never a hang; one
        round trip, not several); nothing for later takes starts before that take is done (it
        would hold the engines up). Between takes a chunk fills the room left, and waits while
        that is less than a quarter chunk."""
        queued = self.buffer.qsize() + self.in_flight
        if self.taking:  # on weights fresh enough for this take (else its push lands first)
            lack = math.ceil(self.need * (self.per_kept or 1.0) * (1 + MARGIN)) - queued
            fresh = self.ctx.version - self.engine_version <= self.cfg.max_staleness
            return min(self.chunk, lack + EXTRA) if lack > 0 and fresh else 0
        room = int(self._room()) - queued
        return min(self.chunk, room) if room >= max(1, self.chunk // 4) else 0

    def _produce(self, worker: int) -> None:
        ctx = self.ctx
        rng = random.Random(ctx.seed * 7919 + worker + 1_000 * ctx.version)
        retry: list = []  # a chunk an engine restart cut short: redone with the same prompts
        try:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                with self.cv:
                    while not self.stop.is_set():
                        size = min(self._chunk_size(), len(ctx.train_tasks))
                        if size:
                            break
                        self.waiting += 1
                        self.cv.wait(0.1)
                        self.waiting -= 1
                    else:
                        return
                    size = len(retry) or size
                    self.in_flight += size
                self.blocked[worker] += time.perf_counter() - t0
                # the run's task order (ctx.order) is shared by the workers: in epochs each takes the next slice
                tasks, retry = retry or ctx.order.draw(rng, size), []
                params = replace(ctx.params, seed=rng.randrange(2**31))
                try:
                    with self.lock:
                        groups = ctx.rollouts.run(tasks, ctx.rollout.n, params)
                except EngineRestarted as e:  # wait for the trainer to push weights, then redo the chunk
                    with self.cv:
                        self.in_flight -= size
                    self.restarted, retry = e, tasks
                    while not self.resynced.wait(0.1) and not self.stop.is_set():
                        pass
                    continue
                for g in groups:
                    self._put(worker, g)
                    with self.cv:
                        self.in_flight -= 1
        except BaseException as e:  # surfaced to the trainer by take()
            self.error = e

    def _put(self, worker: int, group: Group) -> None:
        t0 = time.perf_counter()
        while not self.stop.is_set():
            try:
                self.buffer.put(group, timeout=0.1)
                break
            except queue.Full:
                continue
        self.blocked[worker] += time.perf_counter() - t0

    def take(self) -> tuple[list[Group], dict[str, float]]:
        """The next ``rollout.batch_size`` groups that pass the filters and the staleness bound."""
        ctx, r = self.ctx, self.ctx.rollout
        kept, sampled, c = self.partial
        c.setdefault("dropped", 0), c.setdefault("stale", 0), c.setdefault("waited", 0.0)
        lags = c.setdefault("lags", [])
        self.partial = (kept, sampled, c)  # an EngineRestarted below keeps what was taken so far
        try:
            self._set_taking(r.batch_size - len(kept))
            while len(kept) < r.batch_size:
                t0 = time.perf_counter()
                g = self._get()
                c["waited"] += time.perf_counter() - t0
                sampled.append(g)
                lag = ctx.version - min(s.weight_version for s in g.samples)
                if lag > self.cfg.max_staleness and self.cfg.stale_policy == "drop":
                    c["stale"] += 1
                elif ctx.rollouts.keep(g):
                    kept.append(g)
                    lags.append(lag)
                else:
                    c["dropped"] += 1
                self._set_taking(r.batch_size - len(kept))
        finally:
            with self.cv:
                self.taking = False
        with self.cv:
            self.taken_at = ctx.version
            fresh = (len(kept) + c["dropped"]) / len(kept)
            self.per_kept = fresh if self.per_kept is None else 0.75 * self.per_kept + 0.25 * fresh
            self.cv.notify_all()
        self.partial = ([], [], {})
        dropped, stale, waited = c["dropped"], c["stale"], c["waited"]
        samples = [s for g in sampled for s in g.samples]
        blocked = sum(self.blocked) / len(self.blocked)
        blocked_mark, self.idle_mark = self.idle_mark, blocked
        return kept, {
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "groups_kept": len(kept), "groups_dropped": dropped, "groups_dropped_stale": stale,
            "staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags)),
            # the distribution: the share of the kept groups k versions old, for each k seen
            **{f"staleness_frac_{k}": lags.count(k) / len(lags) for k in sorted(set(lags))},
            "buffer_depth": float(self.buffer.qsize()), "trainer_idle_seconds": waited,
            "engine_idle_seconds": blocked - blocked_mark,
            "response_length_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "resumed_samples": sum(len(s.weight_versions) > 1 for s in samples),
            "rollout_seconds": waited, **ctx.rollouts.metrics(samples), **ctx.order.metrics()}

    def _set_taking(self, need: int) -> None:
        with self.cv:
            self.taking, self.need = True, need
            if self.waiting and self._chunk_size():  # wake a producer only when one may start
                self.cv.notify()

    def _get(self) -> Group:
        while True:
            if self.restarted is not None:
                e, self.restarted = self.restarted, None
                self.resynced.clear()
                raise e
            if self.error is not None:
                raise MilesError(f"rollout worker failed: {type(self.error).__name__}: {self.error}")
            try:
                return self.buffer.get(timeout=0.1)
            except queue.Empty:
                continue
