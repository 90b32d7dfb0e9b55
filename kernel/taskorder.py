"""Which training tasks each RL step rolls out (``miles.rollouts.ModeContext.order``).

By default a step samples its prompts at random from the training split, so across steps some
prompts come often and others never. An env that is a ``miles.protocols.TrainsInEpochs`` (the
``dataset`` env) is visited in epochs instead, as TRL, verl and slime do: each epoch uses every
task exactly once, in an order shuffled by ``run.seed`` and the epoch number; steps take
consecutive slices of it, and the slice that reaches an epoch's end runs on into the next epoch.
"""
from __future__ import annotations

import random
import threading
from typing import Any, Sequence

from .protocols import TrainsInEpochs
from .types import Task


class TaskOrder:
    """Draws the tasks of each step. In epochs, ``consumed`` counts the tasks drawn so far and
    the checkpoint keeps it: since epoch ``e``'s order is a pure function of ``(seed, e)``, that
    one number is all a resumed run needs to go on where the uninterrupted run would be, however
    many tasks the filters' refill rounds drew. Thread-safe: the async mode's workers share it."""

    def __init__(self, tasks: Sequence[Task], seed: int, epochs: bool = False, shuffle: bool = True) -> None:
        self.tasks, self.seed, self.epochs, self.shuffle = list(tasks), seed, epochs, shuffle
        self.consumed = 0
        self._lock = threading.Lock()
        self._cached: tuple[int, list[int]] = (-1, [])  # one epoch's order: drawing it costs a shuffle

    @classmethod
    def for_env(cls, env: Any, seed: int) -> TaskOrder:
        """The order of ``env``'s training tasks: in epochs if the env asks for them."""
        if isinstance(env, TrainsInEpochs):
            return cls(env.tasks("train"), seed, epochs=True, shuffle=bool(env.shuffle_epochs))
        return cls(env.tasks("train"), seed)

    def permutation(self, epoch: int) -> list[int]:
        """The task indices of epoch ``epoch`` in the order it visits them."""
        if self._cached[0] != epoch:
            order = list(range(len(self.tasks)))
            if self.shuffle:  # a string seed is hashed with SHA-512: the same order in every process
                random.Random(f"miles-epoch:{self.seed}:{epoch}").shuffle(order)
            self._cached = (epoch, order)
        return self._cached[1]

    def draw(self, rng: random.Random, k: int) -> list[Task]:
        """``k`` tasks (at most the split's size): in epochs the next ones of the epoch order,
        else a sample drawn with ``rng`` (the step's or a worker's)."""
        k = min(k, len(self.tasks))
        if not self.epochs:
            return rng.sample(self.tasks, k)
        with self._lock:
            n, start = len(self.tasks), self.consumed
            self.consumed += k
            return [self.tasks[self.permutation(i // n)[i % n]] for i in range(start, start + k)]

    def metrics(self) -> dict[str, float]:
        """In epochs, ``epoch``: the epochs drawn so far, a fraction (TRL's convention: 1.0 when
        the first one is complete, 1.5 halfway through the second)."""
        return {"epoch": self.consumed / len(self.tasks)} if self.epochs and self.tasks else {}
