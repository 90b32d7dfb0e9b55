"""The few weight-sync pieces the kernel itself needs (the async loop's background push).

The wire library shared by transports and engines (byte layouts, bucketing, packing, checksums,
process groups, the disk format) is the ``miles-wire`` distribution, ``import miles_wire``; it
re-exports these names.
"""
from __future__ import annotations

from typing import Any, Sequence

from .errors import MilesError


def nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def is_sender(trainer: Any) -> bool:
    """Only trainer rank 0 talks to engines; other ranks just take part in ``named_weights()``."""
    return int(getattr(trainer, "rank", 0) or 0) == 0


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
