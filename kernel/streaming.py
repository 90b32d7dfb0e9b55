"""``run.mode: async``: rollout workers stream finished groups into a bounded buffer that the
trainer drains at its own pace; new weights reach the engines after every step while generation
goes on. The workers are paced: they generate no group that would be more than
``rollout.max_staleness`` weight versions old when the trainer takes it. Groups that still are
(the trainer slowed down) are dropped or kept (``rollout.stale_policy``); a sample's age is that
of its oldest tokens (``Sample.weight_version``). Samples from older weights than the trainer's
are trained with truncated importance weights (``rollout.correct_stale``). Requests in flight at
a weight push finish on the old weights, or (``rollout.in_flight: resume``) are aborted and
resumed on the new ones by the engine client.
"""
from __future__ import annotations

import contextlib
import math
import queue
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from .errors import ConfigError, EngineRestarted, MilesError
from .plugins import call_all
from .types import Group

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

    def __init__(self, loop: Any):
        self.loop, r = loop, loop.cfg.rollout
        self.buffer: queue.Queue[Group] = queue.Queue(maxsize=r.buffer_groups or 2 * r.batch_size)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.restarted: EngineRestarted | None = None  # set by a worker, cleared after a re-sync
        self.resynced = threading.Event()
        self.partial: tuple[list, list, dict[str, float]] = ([], [], {})  # take() state across retries
        self.blocked = [0.0] * r.async_workers  # seconds each worker waited (pacing, full buffer)
        self.idle_mark = 0.0
        self.chunk = r.batch_size  # prompts per request at most: pacing sizes each one
        self.cv = threading.Condition()  # guards the pacing state below
        self.engine_version = loop.version  # the weights the engines hold: the last push that landed
        self.taking = False  # the trainer is in take()
        self.need = 0  # kept groups the take in progress still needs
        self.taken_at: int | None = None  # loop.version at the last completed take
        self.in_flight = 0  # groups requested from the engines and not in the buffer yet
        self.waiting = 0  # producers waiting for room
        self.per_kept: float | None = None  # groups sampled per group kept (filters), recent takes
        self.threads = [threading.Thread(target=self._produce, args=(i,), daemon=True,
                                         name=f"miles-rollout-{i}") for i in range(r.async_workers)]

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
        loop, r = self.loop, self.loop.cfg.rollout
        per_step = r.batch_size * (self.per_kept or 1.0) * (1 + MARGIN)  # what a take takes
        # the step that took last has not bumped the version yet
        next_version = loop.version + (self.taken_at == loop.version)
        return max(0, r.max_staleness + self.engine_version - next_version + 1) * per_step

    def _chunk_size(self) -> int:
        """Prompts the next chunk may have (0: wait). Called under ``cv``. A take waiting for
        more than is queued gets what it lacks at once, and a little more (never a hang; one
        round trip, not several); nothing for later takes starts before that take is done (it
        would hold the engines up). Between takes a chunk fills the room left, and waits while
        that is less than a quarter chunk."""
        queued = self.buffer.qsize() + self.in_flight
        if self.taking:  # on weights fresh enough for this take (else its push lands first)
            lack = math.ceil(self.need * (self.per_kept or 1.0) * (1 + MARGIN)) - queued
            fresh = self.loop.version - self.engine_version <= self.loop.cfg.rollout.max_staleness
            return min(self.chunk, lack + EXTRA) if lack > 0 and fresh else 0
        room = int(self._room()) - queued
        return min(self.chunk, room) if room >= max(1, self.chunk // 4) else 0

    def _produce(self, worker: int) -> None:
        loop = self.loop
        rng = random.Random(loop.seed * 7919 + worker + 1_000 * loop.version)
        try:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                with self.cv:
                    while not self.stop.is_set():
                        size = min(self._chunk_size(), len(loop.train_tasks))
                        if size:
                            break
                        self.waiting += 1
                        self.cv.wait(0.1)
                        self.waiting -= 1
                    else:
                        return
                    self.in_flight += size
                self.blocked[worker] += time.perf_counter() - t0
                tasks = rng.sample(loop.train_tasks, size)
                params = replace(loop.params, seed=rng.randrange(2**31))
                try:
                    groups = loop.rollout(tasks, loop.cfg.rollout.n, params)
                except EngineRestarted as e:  # wait for the trainer to push weights, then redo the chunk
                    with self.cv:
                        self.in_flight -= size
                    self.restarted = e
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
        loop, r = self.loop, self.loop.cfg.rollout
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
                lag = loop.version - min(s.weight_version for s in g.samples)
                if lag > r.max_staleness and r.stale_policy == "drop":
                    c["stale"] += 1
                elif loop.p.algorithm.keep(g) and False not in call_all(loop.pm, "miles_filter", group=g):
                    kept.append(g)
                    lags.append(lag)
                else:
                    c["dropped"] += 1
                self._set_taking(r.batch_size - len(kept))
        finally:
            with self.cv:
                self.taking = False
        with self.cv:
            self.taken_at = loop.version
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
            "buffer_depth": float(self.buffer.qsize()), "trainer_idle_seconds": waited,
            "engine_idle_seconds": blocked - blocked_mark,
            "response_length_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "resumed_samples": sum(len(s.weight_versions) > 1 for s in samples),
            "rollout_seconds": waited}

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


class Snapshot:
    """A trainer's weights copied at one version (the next optimizer step changes them in place),
    as a transport reads a trainer. ``named_weights`` is a collective: every rank takes part, only
    the sending rank keeps a copy."""

    rank = 0

    def __init__(self, trainer: Any):
        from .weights import is_sender, nbytes

        keep = is_sender(trainer)
        self.weights = [(n, t.detach().clone()) for n, t in trainer.named_weights() if keep]
        self.nbytes = sum(nbytes(t) for _, t in self.weights)

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        return iter(self.weights)


def push_in_background(loop: Any, trainer: Any, engines: list) -> tuple[Any, dict[str, float]]:
    """Copy the trainer's weights, then push the copy as ``loop.version`` on a thread: the
    ``Calls`` of that push (None on ranks that send nothing) and the trainer's blocking cost."""
    from .weights import Calls

    t0, version = time.perf_counter(), loop.version
    snap = Snapshot(trainer)

    def push() -> dict[str, float]:
        with loop.engine_lock, pushing(loop, engines, version):
            return loop.p.transport.sync(snap, engines, version)
    calls = Calls([push]) if snap.weights else None
    if loop.streamer is not None:  # a new version: producers may wait for it to land
        loop.streamer.wake()
    return calls, {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_bytes": float(snap.nbytes)}


def start(loop: Any) -> Streamer | None:
    """The streamer of an async run (rank 0, rollout algorithms), started; else None."""
    if loop.cfg.run.mode != "async" or not loop.main or not loop.p.algorithm.uses_rollout:
        return None
    if not getattr(loop.p.engine, "remote", False):  # one in-process engine: take turns
        loop.engine_lock = threading.Lock()
    streamer = Streamer(loop)
    streamer.start()
    return streamer


def check_engine(loop: Any) -> None:
    """``rollout.in_flight: resume`` needs an engine that aborts and resumes requests in flight."""
    engine = loop.p.engine  # None on trainer ranks other than 0
    if loop.cfg.rollout.in_flight == "resume" and engine is not None \
            and not hasattr(engine, "pause_generation"):
        raise ConfigError([("rollout.in_flight: resume needs engines in their own processes that "
                            "abort and resume requests (launcher.engines >= 1, or engine.name: "
                            f"sglang); engine {loop.cfg.name('engine')!r} here runs in the trainer's "
                            "process and cannot: set rollout.in_flight: finish")])


@contextlib.contextmanager
def pushing(loop: Any, engines: list, version: int) -> Iterator[None]:
    """Around a weight push of ``version``. A streaming run's producers learn when it has landed
    (pacing); with ``rollout.in_flight: resume`` the engines first abort the requests in flight
    (each answers with what it generated so far, and the engine client resumes it after
    ``continue_generation``) and hold new ones until the weights are in."""
    streamer = loop.streamer
    resume = streamer is not None and loop.cfg.rollout.in_flight == "resume"
    try:
        for e in engines if resume else ():
            e.pause_generation(mode="abort")
        yield
    finally:
        for e in engines if resume else ():
            e.continue_generation()
    if streamer is not None:
        streamer.wake(landed=version)


def reweight(loop: Any, batch: Any, logprobs: Any) -> tuple[Any, dict[str, float]]:
    """The batch the loss sees. Async runs: the advantages of stale samples times truncated
    importance weights min(pi_prox / pi_rollout, ``importance_cap``) per token (decoupled PPO),
    pi_prox being the policy before this step's update: ``batch.old_logprobs``, or, when one
    optimizer step takes the whole batch, the ``logprobs`` being trained (no extra forward pass).
    Stale: from older weights than the trainer's (``correct_stale``), else only groups kept past
    ``max_staleness`` (``stale_policy: importance``). Every rank does the same."""
    r = loop.cfg.rollout
    oldest = 1 if r.correct_stale else r.max_staleness + 1 if r.stale_policy == "importance" else 0
    if loop.cfg.run.mode != "async" or not oldest or not batch.samples or not batch.samples[0].logprobs:
        return batch, {}
    import torch

    stale = torch.tensor([loop.version - s.weight_version >= oldest for s in batch.samples],
                         device=logprobs.device)
    if not stale.any():
        return batch, {}
    prox = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    w = torch.where(stale[:, None], torch.exp(prox - batch.rollout_logprobs).clamp(max=r.importance_cap), 1.0)
    m = batch.loss_mask * stale[:, None]
    return replace(batch, advantages=batch.advantages * w), \
        {"importance_weight_mean": float((w * m).sum() / m.sum().clamp(min=1))}


def finish_push(loop: Any) -> dict[str, float]:
    """Wait for the background push in flight, if any: its transport's own seconds."""
    calls, loop._push = loop._push, None
    return {"weight_push_seconds": calls.join()[0]["weight_sync_seconds"]} if calls else {}
