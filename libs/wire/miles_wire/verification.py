"""Verification of a sync: every engine holds the pushed version and tensors whose checksums are
the trainer's, else a ``MilesError`` naming the first tensor that differs."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles import MilesError

from .dtypes import checksum


def verify(engines: Sequence[Any], want: dict[str, str], version: int) -> None:
    """Every engine holds ``version`` and tensors whose checksums are ``want``, else MilesError."""
    from miles.protocols import LoadsWeights

    for i, engine in enumerate(engines):
        who = f"engine {i}" if len(engines) > 1 else "engine"
        have = engine.weight_version if isinstance(engine, LoadsWeights) else version
        if have is not None and int(have) != int(version):
            raise MilesError(f"weight sync verification failed: {who} reports weight_version "
                             f"{have}, expected {version}")
        got = engine_checksums(engine, list(want))
        if got is not None:
            expect_same(want, got, who)


def engine_checksums(engine: Any, names: Sequence[str]) -> dict[str, str] | None:
    """``engine.weight_checksums(names)``, or checksums of ``engine.named_weights()`` for an
    in-process engine that only offers the latter. None: no part of the engine holds the
    version just pushed (its servers went down meanwhile; they are re-synced once back)."""
    from miles.protocols import ReportsChecksums, WeightSource

    if isinstance(engine, ReportsChecksums):
        got = engine.weight_checksums(list(names))
        return None if got is None else dict(got)
    if isinstance(engine, WeightSource):
        wanted = set(names)
        return {n: checksum(t) for n, t in engine.named_weights() if n in wanted}
    raise MilesError(f"transport.verify needs an engine with weight_checksums() or named_weights(); "
                     f"{type(engine).__name__} has neither (set transport.verify=false)")


def expect_same(want: dict[str, str], got: dict[str, str], who: str = "engine") -> None:
    """Raise ``MilesError`` naming the first tensor (in ``want``'s order) whose checksum differs."""
    for name, digest in want.items():
        have = got.get(name)
        if have != digest:
            detail = "is missing" if have is None else f"has checksum {have}, the trainer's is {digest}"
            raise MilesError(f"weight sync verification failed: {who} tensor {name} {detail} (an "
                             "engine running another dtype than the trainer can never match: use "
                             "transport.verify=false there)")
