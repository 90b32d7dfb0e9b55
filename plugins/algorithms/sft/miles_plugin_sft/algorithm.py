"""SFT: maximise the log-likelihood of demonstration tokens where ``loss_mask`` is 1."""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from miles import Batch, Group, Sample
from miles_rlmath.masked import aggregate

from .config import SFTConfig


class SFT:
    """Supervised fine-tuning, implementing ``miles.protocols.Algorithm``.

    The loop feeds demonstration samples (``uses_rollout = False``): ``response_ids`` are the
    target tokens and ``loss_mask`` marks the ones to learn (e.g. not tool output). With
    ``data`` set the samples come from that dataset file (``supervised_samples``), otherwise
    from the env's demonstrations; with ``pack`` the loop's batches are packed rows
    (``make_batch``).
    """

    uses_rollout = False
    needs_reference = False
    needs_critic = False

    def __init__(self, cfg: SFTConfig | None = None):
        self.cfg = cfg if cfg is not None else SFTConfig()
        self._source = None
        self._demos: tuple[Any, list] | None = None  # (env, its demonstrations)
        if self.cfg.data is not None:
            from .data import DatasetSource

            self._source = DatasetSource(self.cfg)

    def supervised_samples(self, tokenizer: Any, count: int, rng: random.Random, version: int = 0, *,
                           env: Any = None, rollout: Any = None) -> list[Sample] | None:
        """``count`` examples of the dataset file, else of the ``env``'s demonstrations (multi-turn
        ones laid out by the ``rollout`` component); None without either."""
        if self._source is not None:
            return self._source.samples(tokenizer, count, rng, version)
        if env is None:
            return None
        from .demos import demo_samples, demonstrations

        if self._demos is None or self._demos[0] is not env:  # listed once per env, not every step
            self._demos = (env, demonstrations(env, "algorithm sft",
                                               "set algorithm.data to a dataset file, or pick an env with them"))
        return demo_samples(self._demos[1], count, rng, tokenizer=tokenizer, env=env, rollout=rollout,
                            version=version)

    def make_batch(self, samples: list[Sample], pad_id: int, advantages=None) -> Batch:
        if not self.cfg.pack:
            return Batch.from_samples(samples, pad_id, advantages)
        from .packing import pack

        return pack(samples, pad_id, self.cfg.pack_length)

    def keep(self, group: Group) -> bool:
        return True

    def advantages(self, groups: Sequence[Group]) -> list[list[float]]:
        # Demonstrations carry no reward signal; zeros keep the Batch shape contract.
        return [[0.0] * len(g.samples) for g in groups]

    def loss(self, batch: Batch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -aggregate(batch, logprobs, self.cfg.loss_agg)
        # Reported on the micro-batch's own scale, so averaging over micro-batches is meaningful.
        own = -aggregate(batch.as_global(), logprobs.detach(), self.cfg.loss_agg)
        return loss, {"sft_loss": float(own)}
