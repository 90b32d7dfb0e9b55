"""SFT: maximise the log-likelihood of demonstration tokens where ``loss_mask`` is 1."""
from __future__ import annotations

from typing import Sequence

import torch

from miles import Batch, Group

from .config import SFTConfig


class SFT:
    """Supervised fine-tuning, implementing ``miles.protocols.Algorithm``.

    The loop feeds demonstration samples (``uses_rollout = False``): ``response_ids`` are the
    target tokens and ``loss_mask`` marks the ones to learn (e.g. not tool output).
    """

    uses_rollout = False
    needs_reference = False

    def __init__(self, cfg: SFTConfig | None = None):
        self.cfg = cfg if cfg is not None else SFTConfig()

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
