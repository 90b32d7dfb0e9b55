"""The trainer as a weight-sync transport sees it: a subset of its weights, or the packed weights
its forward computed with."""
from __future__ import annotations

from typing import Any, Iterator

from .protocols import Distributed


class SyncView:
    """The trainer as a transport sees it when the model spec is a ``SyncFilter``: only the weights
    it accepts (those training changes) are sent. ``rank``: only rank 0 talks to engines."""

    def __init__(self, trainer: Any, keep: Any) -> None:
        self._trainer, self._keep = trainer, keep
        self.rank = trainer.rank if isinstance(trainer, Distributed) else 0

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        return ((n, t) for n, t in self._trainer.named_weights() if self._keep(n))


class PackedView:
    """The trainer as a transport sees it when it computes with rounded weights (``SendsPacked``):
    the engines get those weights packed, the ones the trainer's forward used. Everything else
    (rank, world size, collectives) is the trainer's."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        return self._trainer.packed_weights()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)
