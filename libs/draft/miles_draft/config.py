"""The top-level ``draft`` section: online training of the speculative-decoding draft head."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MIN_VOCAB = 16  # fewer draft tokens than this cover too little of any real text to draft with


def vocab_too_big(n: int | None, vocab_size: int) -> str | None:
    """The error of a ``draft.vocab`` of ``n`` for a model of ``vocab_size`` tokens, or None."""
    if n is None or n <= vocab_size:
        return None
    return (f"draft.vocab: {n} is more than the model's vocabulary of {vocab_size} tokens; use at most "
            f"{vocab_size}, or null for all")


class DraftConfig(BaseModel):
    """``draft:``. The head always learns during supervised steps (the warm start); ``train``
    says whether every RL step trains it too (online) or leaves it as it was (frozen)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    train: bool = Field(True, description="train the head on every RL step's rollouts toward the current "
                        "policy's next-token distribution (online); false: it keeps what the warm start taught it "
                        "(frozen)")
    lr: float = Field(1e-3, gt=0, description="the head's own AdamW learning rate (constant)")
    loss_weight: float = Field(1.0, gt=0, description="weight of the head's loss (it never reaches the policy's "
                               "gradients: the policy's hidden states are detached)")
    unroll: int = Field(2, ge=1, le=8, description="drafting steps unrolled in training: step s feeds the head "
                        "its own feature from step s-1, as drafting k > 1 tokens does")
    grad_clip: float | None = Field(1.0, gt=0, description="the head's own gradient-norm clip (null: none)")
    updates_per_step: int = Field(1, ge=1, le=64, description="optimizer updates of the head per RL step, each a "
                                  "pass over the step's rollouts (the policy's hidden states and targets are "
                                  "computed once); more lets the head keep up with a policy that drifts fast. "
                                  "The warm start's supervised steps take one. The reported draft_loss and "
                                  "draft_top1 are the first pass's (before this step's updates)")
    vocab: int | None = Field(None, ge=MIN_VOCAB, description="a reduced draft vocabulary (EAGLE-3): the head "
                              "scores only this many target tokens, the most frequent next tokens of its "
                              "training data (the warm start's and the RL steps' response tokens, counted with "
                              "the head and refreshed every training step), which cuts its products with the "
                              "whole output matrix; sampling stays exact (the draft puts no probability on the "
                              f"other tokens). At least {MIN_VOCAB}, at most the model's vocabulary; null: all "
                              "of it")
