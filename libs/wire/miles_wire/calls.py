"""Calls to engines: run concurrently on daemon threads (a push in the background is one
``Calls``); which trainer rank talks to engines; whether an engine lives in another process."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles import MilesError


class Calls:
    """Zero-argument calls running concurrently on daemon threads (remote engines block on a
    rendezvous or a transfer while this thread takes part in it). ``check()`` raises the first
    error as soon as there is one; ``join()`` waits for all and returns their results. Daemon
    threads: a call stuck on a dead peer never keeps the process from exiting."""

    def __init__(self, calls: Sequence[Any]):
        import threading

        self.results: list[Any] = [None] * len(calls)
        self._error: BaseException | None = None
        self._left = len(calls)
        self._done = threading.Condition()
        for i, call in enumerate(calls):
            threading.Thread(target=self._run, args=(i, call), daemon=True).start()

    def _run(self, i: int, call: Any) -> None:
        try:
            self.results[i] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised by check()/join()
            with self._done:
                self._error = self._error or e
        with self._done:
            self._left -= 1
            self._done.notify_all()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def join(self, timeout_s: float | None = None) -> list[Any]:
        with self._done:
            ok = self._done.wait_for(lambda: self._left == 0 or self._error is not None, timeout_s)
        self.check()
        if not ok:
            raise MilesError(f"weight sync: engines did not answer within {timeout_s:.0f} s")
        return self.results


def parallel(calls: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
    """Run ``calls`` concurrently (inline when there is one) and return their results."""
    if len(calls) == 1 and timeout_s is None:
        return [calls[0]()]
    return Calls(calls).join(timeout_s)


def is_sender(trainer: Any) -> bool:
    """Only trainer rank 0 talks to engines; other ranks just take part in ``named_weights()``
    (a source without a ``rank``, e.g. a snapshot, is rank 0's)."""
    from miles.protocols import OnRank

    return not isinstance(trainer, OnRank) or int(trainer.rank or 0) == 0


def is_remote(engine: Any) -> bool:
    """True for an engine in another process: a ``ReceivesWeights`` engine that says ``remote``,
    or one that cannot take tensors by reference (not ``LoadsWeights``)."""
    from miles.protocols import LoadsWeights, ReceivesWeights

    return (isinstance(engine, ReceivesWeights) and bool(engine.remote)) or not isinstance(engine, LoadsWeights)


def servers_down(engines: Sequence[Any]) -> list[str]:
    """Servers of ``engines`` that do not answer now (a ``ServerGroup`` can tell; a failed probe
    tells nothing: the push's own error is the one to raise)."""
    from miles.protocols import ServerGroup

    down: list[str] = []
    for e in engines:
        try:
            down += e.servers_down() if isinstance(e, ServerGroup) else []
        except Exception:  # noqa: BLE001
            pass
    return down


def members(engines: Sequence[Any]) -> list[tuple[int, int]]:
    """Which engines, and how often each restarted: a restarted server has left every weight-update
    group it was in and has a new transfer endpoint, so a transport reconnects when this changes."""
    from miles.protocols import ServerGroup

    return [(id(e), int(e.restarts) if isinstance(e, ServerGroup) else 0) for e in engines]
