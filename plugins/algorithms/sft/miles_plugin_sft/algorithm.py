"""SFT: maximise the log-likelihood of demonstration tokens where ``loss_mask`` is 1."""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from miles import Batch, Group, Sample

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

    def __init__(self, cfg: SFTConfig | None = None):
        self.cfg = cfg if cfg is not None else SFTConfig()
        self._source = None
        if self.cfg.data is not None:
            from .data import DatasetSource

            self._source = DatasetSource(self.cfg)

    def supervised_samples(self, tokenizer: Any, count: int, rng: random.Random,
                           version: int = 0) -> list[Sample] | None:
        """``count`` examples of the dataset file, or None (the loop then uses the env's
        demonstrations)."""
        if self._source is None:
            return None
        return self._source.samples(tokenizer, count, rng, version)

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

    def _aggregate(self, batch: Batch, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.loss_agg == "seq-mean-token-mean":
            return batch.seq_mean(x)
        return batch.token_mean(x)

    def loss(self, batch: Batch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -self._aggregate(batch, logprobs)
        # Reported on the micro-batch's own scale, so averaging over micro-batches is meaningful.
        own = -self._aggregate(batch.as_global(), logprobs.detach())
        return loss, {"sft_loss": float(own)}
