"""``run.mode: async``: rollout workers stream finished groups into a bounded buffer that the
trainer drains at its own pace; new weights reach the engines after every step while generation
goes on. Groups more than ``rollout.max_staleness`` weight versions old are dropped or kept with
truncated importance weights (``rollout.stale_policy``); a sample's age is that of its oldest
tokens (``Sample.weight_version``). Requests in flight at a weight push finish on the old weights,
or (``rollout.in_flight: resume``) are aborted and resumed on the new ones by the engine client.
"""
from __future__ import annotations

import contextlib
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


class Streamer:
    """Producer threads (each keeps one chunk of requests in flight at the engines) plus the
    trainer-side ``take``. An in-process engine is shared under a lock, so a weight update waits
    for the chunk being generated (it finishes on the old weights); remote engines serialise
    requests and updates themselves."""

    def __init__(self, loop: Any):
        self.loop, r = loop, loop.cfg.rollout
        self.buffer: queue.Queue[Group] = queue.Queue(maxsize=r.buffer_groups or 2 * r.batch_size)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.restarted: EngineRestarted | None = None  # set by a worker, cleared after a re-sync
        self.resynced = threading.Event()
        self.partial: tuple[list, list, dict[str, float]] = ([], [], {})  # take() state across retries
        self.blocked = [0.0] * r.async_workers  # seconds each worker waited for buffer space
        self.idle_mark = 0.0
        chunk = max(1, -(-r.batch_size // r.async_workers))
        self.threads = [threading.Thread(target=self._produce, args=(i, chunk), daemon=True,
                                         name=f"miles-rollout-{i}") for i in range(r.async_workers)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self.buffer.get_nowait()
        for t in self.threads:
            t.join(timeout=30)

    def _produce(self, worker: int, chunk: int) -> None:
        loop = self.loop
        rng = random.Random(loop.seed * 7919 + worker + 1_000 * loop.version)
        try:
            while not self.stop.is_set():
                tasks = rng.sample(loop.train_tasks, min(chunk, len(loop.train_tasks)))
                params = replace(loop.params, seed=rng.randrange(2**31))
                try:
                    groups = loop.rollout(tasks, loop.cfg.rollout.n, params)
                except EngineRestarted as e:  # wait for the trainer to push weights, then redo the chunk
                    self.restarted = e
                    while not self.resynced.wait(0.1) and not self.stop.is_set():
                        pass
                    continue
                for g in groups:
                    self._put(worker, g)
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
        while len(kept) < r.batch_size:
            t0 = time.perf_counter()
            g = self._get()
            c["waited"] += time.perf_counter() - t0
            sampled.append(g)
            lag = loop.version - min(s.weight_version for s in g.samples)
            if lag > r.max_staleness and r.stale_policy == "drop":
                c["stale"] += 1
                continue
            if loop.p.algorithm.keep(g) and False not in call_all(loop.pm, "miles_filter", group=g):
                kept.append(g)
                lags.append(lag)
            else:
                c["dropped"] += 1
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
        with loop.engine_lock, paused(loop, engines):
            return loop.p.transport.sync(snap, engines, version)
    calls = Calls([push]) if snap.weights else None
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
def paused(loop: Any, engines: list) -> Iterator[None]:
    """Around a weight push of a streaming run with ``rollout.in_flight: resume``: the engines
    abort the requests in flight (each answers with what it generated so far, and the engine
    client resumes it after ``continue_generation``) and hold new ones until the weights are in."""
    if loop.streamer is None or loop.cfg.rollout.in_flight != "resume":
        yield
        return
    try:
        for e in engines:
            e.pause_generation(mode="abort")
        yield
    finally:
        for e in engines:
            e.continue_generation()


def importance(loop: Any, batch: Any) -> None:
    """Samples older than ``max_staleness``: advantages times truncated importance weights
    min(pi_old / pi_rollout, cap), against the trainer's current (pre-update) policy, which
    becomes the PPO ratio's reference."""
    import torch

    r = loop.cfg.rollout
    stale = torch.tensor([loop.version - s.weight_version > r.max_staleness for s in batch.samples])
    if stale.any():
        if batch.old_logprobs is None:
            batch.old_logprobs = loop.p.trainer.logprobs(batch, "policy")
        w = torch.exp(batch.old_logprobs - batch.rollout_logprobs).clamp(max=r.importance_cap) * batch.loss_mask
        batch.advantages = torch.where(stale[:, None], batch.advantages * w, batch.advantages)
