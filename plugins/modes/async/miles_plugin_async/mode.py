"""``run.mode: async`` as a ``miles.protocols.Mode``: rollout workers (``streamer``) generate
while the trainer trains; each training step's weights are copied and pushed to the engines on a
thread while the trainer goes on with the next step (the next push, an evaluation and the end of
the run wait for it). Samples from older weights than the trainer's are trained with truncated
importance weights (``rollout.correct_stale``). Requests in flight at a weight push finish on the
old weights, or (``rollout.in_flight: resume``) are aborted and resumed on the new ones by the
engine client.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from miles import MilesError
from miles.protocols import Pausable
from miles_wire import Calls, is_sender, nbytes

from .streamer import Streamer


class AsyncMode:
    """Built on every trainer rank; rank 0 alone runs the rollout workers, started by the first
    ``take`` (after step 0's push and evaluation, or the resumed checkpoint's push)."""

    def __init__(self, cfg: Any, ctx: Any):
        self.cfg, self.ctx = cfg, ctx  # AsyncConfig, miles.rollouts.ModeContext
        self.streamer: Streamer | None = None
        self.pending: Calls | None = None  # the background push in flight (None on non-sending ranks)
        if cfg.in_flight == "resume" and not all(isinstance(e, Pausable) for e in ctx.engines):
            raise MilesError("rollout.in_flight: resume needs engines that abort and resume requests "
                             "(launcher.engines >= 1, or engine.name: sglang): set rollout.in_flight: finish")
        # one in-process engine: the workers, evaluation and pushes take turns; remote engines
        # serialise requests and updates themselves
        local = bool(ctx.engines) and not ctx.remote
        self.lock: Any = threading.Lock() if local else contextlib.nullcontext()

    def take(self, rng: Any, params: Any) -> tuple[list, dict[str, float]]:
        """The next ``rollout.batch_size`` groups from the workers (which draw their own tasks
        and sampling seeds: ``rng`` and ``params`` are the loop's for a sync step)."""
        if self.streamer is None:
            self.streamer = Streamer(self.cfg, self.ctx, self.lock)
            self.streamer.start()
        return self.streamer.take()

    def push(self, trainer: Any, engines: list, version: int, wait: bool = True) -> dict[str, float]:
        """``wait=False`` and a rollout algorithm: copy the weights, push the copy on a thread
        (metrics: the trainer's blocking cost); else push now."""
        done = self.finish_push()
        if wait or not self.ctx.uses_rollout:
            with self.lock, self.pushing(engines, version):
                m = self.ctx.transport.sync(trainer, engines, version)
            if self.streamer is not None:  # running workers: only a re-sync after an engine restart
                self.streamer.resynced.set()  # waits, and the workers stopped by it go on
            return {**done, **m}
        t0 = time.perf_counter()
        snap = Snapshot(trainer)

        def push() -> dict[str, float]:
            with self.lock, self.pushing(engines, version):
                return self.ctx.transport.sync(snap, engines, version)
        self.pending = Calls([push]) if snap.weights else None
        if self.streamer is not None:  # a new version: producers may wait for it to land
            self.streamer.wake()
        return {**done, "weight_sync_seconds": time.perf_counter() - t0,
                "weight_sync_bytes": float(snap.nbytes)}

    def finish_push(self) -> dict[str, float]:
        """Wait for the background push in flight, if any: its transport's own seconds."""
        calls, self.pending = self.pending, None
        return {"weight_push_seconds": calls.join()[0]["weight_sync_seconds"]} if calls else {}

    @contextlib.contextmanager
    def pushing(self, engines: list, version: int) -> Iterator[None]:
        """Around a weight push of ``version``. The producers learn when it has landed (pacing);
        with ``rollout.in_flight: resume`` the engines first abort the requests in flight (each
        answers with what it generated so far, and the engine client resumes it after
        ``continue_generation``) and hold new ones until the weights are in."""
        streamer = self.streamer
        resume = streamer is not None and self.cfg.in_flight == "resume"
        try:
            for e in engines if resume else ():
                e.pause_generation(mode="abort")
            yield
        finally:
            for e in engines if resume else ():
                e.continue_generation()
        if streamer is not None:
            streamer.wake(landed=version)

    def reweight(self, batch: Any, logprobs: Any) -> tuple[Any, dict[str, float]]:
        return reweight(self.cfg, self.ctx.version, batch, logprobs)

    def lock_engines(self) -> Any:
        return self.lock

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()


class Snapshot:
    """A trainer's weights copied at one version (the next optimizer step changes them in place),
    as a transport reads a trainer. ``named_weights`` is a collective: every rank takes part, only
    the sending rank keeps a copy."""

    rank = 0

    def __init__(self, trainer: Any):
        keep = is_sender(trainer)
        self.weights = [(n, t.detach().clone()) for n, t in trainer.named_weights() if keep]
        self.nbytes = sum(nbytes(t) for _, t in self.weights)

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        return iter(self.weights)


def reweight(r: Any, version: int, batch: Any, logprobs: Any) -> tuple[Any, dict[str, float]]:
    """The batch the loss sees: the advantages of stale samples times truncated importance
    weights min(pi_prox / pi_rollout, ``importance_cap``) per token (decoupled PPO), pi_prox being
    the policy before this step's update: ``batch.old_logprobs``, or, when one optimizer step
    takes the whole batch, the ``logprobs`` being trained (no extra forward pass). Stale: from
    older weights than the trainer's (``correct_stale``), else only groups kept past
    ``max_staleness`` (``stale_policy: importance``), ``r`` being the ``AsyncConfig`` and
    ``version`` the trainer's. Every rank does the same."""
    oldest = 1 if r.correct_stale else r.max_staleness + 1 if r.stale_policy == "importance" else 0
    if not oldest or not batch.samples or not batch.samples[0].logprobs:
        return batch, {}
    import torch

    stale = torch.tensor([version - s.weight_version >= oldest for s in batch.samples],
                         device=logprobs.device)
    if not stale.any():
        return batch, {}
    prox = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    w = torch.where(stale[:, None], torch.exp(prox - batch.rollout_logprobs).clamp(max=r.importance_cap), 1.0)
    m = batch.loss_mask * stale[:, None]
    return replace(batch, advantages=batch.advantages * w), \
        {"importance_weight_mean": float((w * m).sum() / m.sum().clamp(min=1))}
