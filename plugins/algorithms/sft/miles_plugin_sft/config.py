"""SFT configuration (pydantic only: importable without torch)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SFTConfig(BaseModel):
    """Settings of the ``sft`` algorithm (the ``algorithm:`` config section minus ``name``)."""

    model_config = ConfigDict(extra="forbid")

    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = Field("token-mean", description=(
        "How per-token negative log-likelihoods are averaged: 'token-mean' over every trainable "
        "token of the step (long demonstrations weigh more); 'seq-mean-token-mean' averages each "
        "demonstration's token-mean, so every demonstration weighs the same."))
