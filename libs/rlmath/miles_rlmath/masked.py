"""Means over a loss mask: metrics, per-row means, whitening, and the step-level loss aggregations."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from miles import Batch

WHITEN_EPS = 1e-8
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Plain mean of ``x`` over ``mask`` within one micro-batch, as a python float (for metrics;
    0.0 when the mask is empty)."""
    x = x.detach().float()
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` mean of each row of ``x`` ``[B, R]`` over its mask (0 for a row without any): e.g.
    the per-sample outcome an algorithm broadcast over the sample's tokens."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var_unbiased + 1e-8)`` over the masked entries; 0 outside the mask.

    Miles' ``--normalize-advantages`` whitening (``var * n / (n - 1)`` is the unbiased variance);
    with a single masked entry the variance is taken as 0.
    """
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS) * mask


def aggregate(batch: Batch | Any, x: torch.Tensor, loss_agg: str = "token-mean",
              max_response_len: int = 1024) -> torch.Tensor:
    """This micro-batch's share of the step-level aggregate of per-token ``x`` ``[B, R]``.

    ``token-mean``: over every trainable token of the step; ``seq-mean-token-mean``: each
    sequence's token mean, averaged over the step's sequences; ``seq-mean-token-sum-norm``
    (Dr.GRPO): each sequence's token sum over the constant ``max_response_len``, averaged over
    sequences. Every mode divides by step-global constants only (``batch.global_tokens`` /
    ``global_samples``), so summing it over micro-batches gives exactly the value (and gradient)
    of the whole batch.
    """
    if loss_agg == "token-mean":
        return batch.token_mean(x)
    if loss_agg == "seq-mean-token-mean":
        return batch.seq_mean(x)
    if loss_agg == "seq-mean-token-sum-norm":
        return (x * batch.loss_mask).sum() / max_response_len / max(batch.global_samples, 1)
    raise ValueError(f"unknown loss_agg {loss_agg!r}; expected 'token-mean', "
                     f"'seq-mean-token-mean' or 'seq-mean-token-sum-norm'")
