"""Corrections for what the rollout engine and the trainer still disagree on (low-precision
rollout weights, other kernels): every one compares the trainer's log-probs of the generating
policy (``old``) with the engine's (``rollout``), through the ratio ``exp(old - rollout)``.

* TIS (``tis_cap``): each token's loss times ``min(ratio, cap)``;
* the mismatch mask (``mismatch_mask_band``): tokens whose ratio leaves ``[low, high]`` dropped;
* IcePop (``icepop``, Ring-1T's "IcePop"): each token's loss times ``ratio`` inside ``[low, high]``
  and 0 outside (a masked importance weight at the token level);
* sequence-level MIS / RS (``seq_correction``): one ratio per sequence, the geometric mean of its
  token ratios (``exp(mean_t log ratio)``) or their product (``exp(sum_t log ratio)``); ``mis``
  weights the whole sequence by it inside ``seq_band`` and drops it outside, ``rs`` only drops it
  (rejection sampling, no weight). ``seq_veto`` drops any sequence holding a token whose ratio is
  below it, however the others average out.

Each returns the per-token factor ``[B, R]`` (no gradient) that multiplies the policy loss's
numerator; denominators stay the step's, as Miles' ``mis.py`` leaves ``rollout_mask_sums``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .masked import masked_mean
from .ratio import LOG_RATIO_CLAMP, clamped_log_ratio, mismatch_keep, tis_weights

if TYPE_CHECKING:  # pragma: no cover
    from miles import Batch


def token_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """``exp(old_logp - rollout_logp)``, the trainer/rollout probability ratio, detached."""
    return torch.exp(clamped_log_ratio(old_logprobs, rollout_logprobs).detach())


def icepop_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, low: float,
                   high: float) -> torch.Tensor:
    """IcePop: ``ratio`` where ``low <= ratio <= high``, else 0 (Miles' ``icepop_function``)."""
    ratio = token_ratio(old_logprobs, rollout_logprobs)
    return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))


def sequence_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                   kind: str = "geometric") -> torch.Tensor:
    """``[B]`` per-sequence trainer/rollout ratio over the loss mask: ``geometric`` =
    ``exp(mean_t log ratio)`` (length-normalised), ``product`` = ``exp(sum_t log ratio)`` (the
    sequence's true likelihood ratio; its log is clamped to ``[-20, 20]`` before ``exp``)."""
    log_r = (clamped_log_ratio(old_logprobs, rollout_logprobs).detach() * mask).sum(-1)
    if kind == "geometric":
        log_r = log_r / mask.sum(-1).clamp(min=1)
    elif kind != "product":
        raise ValueError(f"sequence ratio kind must be 'geometric' or 'product', got {kind!r}")
    return torch.exp(log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def sequence_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                     mode: str, kind: str, low: float, high: float,
                     veto: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights [B, R], keep [B], ratio [B])`` of sequence-level MIS (``mode="mis"``: weight =
    the sequence ratio inside ``[low, high]``) or RS (``mode="rs"``: weight 1), 0 for a dropped
    sequence: ratio outside the band, or (with ``veto``) any trainable token's ratio below ``veto``."""
    ratio = sequence_ratio(old_logprobs, rollout_logprobs, mask, kind)
    keep = (ratio >= low) & (ratio <= high)
    if veto is not None:
        vetoed = ((token_ratio(old_logprobs, rollout_logprobs) < veto) & (mask > 0)).any(-1)
        keep = keep & ~vetoed
    if mode == "mis":
        w = torch.where(keep, ratio, torch.zeros_like(ratio))
    elif mode == "rs":
        w = keep.to(ratio.dtype)
    else:
        raise ValueError(f"sequence correction must be 'mis' or 'rs', got {mode!r}")
    return w.unsqueeze(-1).expand_as(old_logprobs).to(old_logprobs.dtype), keep, ratio


def any_correction(cfg: Any) -> bool:
    return (cfg.tis_cap is not None or cfg.mismatch_mask_band is not None or cfg.icepop is not None
            or cfg.seq_correction is not None)


def apply_corrections(batch: Batch, per_token: torch.Tensor, old: torch.Tensor, cfg: Any,
                      metrics: dict[str, float]) -> torch.Tensor:
    """``per_token`` times every configured correction's factor; their metrics into ``metrics``.

    Metrics (means over the micro-batch's trainable tokens unless said): ``mismatch_ratio_mean``
    / ``_min`` / ``_max`` (token ratios); ``tis_weight_mean``, ``tis_clipfrac``;
    ``mismatch_masked_frac``; ``icepop_masked_frac``, ``icepop_weight_mean``; ``seq_ratio_mean`` /
    ``_min`` / ``_max`` (over sequences), ``seq_rejected_frac`` (share of sequences dropped),
    ``seq_masked_token_frac``; ``correction_masked_frac``: tokens left with factor 0 by all of them.
    """
    rollout, mask = batch.rollout_logprobs, batch.loss_mask
    on = mask > 0
    ratio = token_ratio(old, rollout)
    if on.any():
        metrics.update(mismatch_ratio_mean=masked_mean(ratio, mask),
                       mismatch_ratio_min=float(ratio[on].min()), mismatch_ratio_max=float(ratio[on].max()))
    factor = torch.ones_like(per_token)
    if cfg.tis_cap is not None:
        w = tis_weights(old, rollout, cfg.tis_cap)
        factor = factor * w
        metrics["tis_weight_mean"] = masked_mean(w, mask)
        metrics["tis_clipfrac"] = masked_mean((w >= cfg.tis_cap).float(), mask)
    if cfg.mismatch_mask_band is not None:
        keep = mismatch_keep(old, rollout, *cfg.mismatch_mask_band)
        factor = factor * keep
        metrics["mismatch_masked_frac"] = masked_mean(1.0 - keep, mask)
    if cfg.icepop is not None:
        w = icepop_weights(old, rollout, *cfg.icepop)
        factor = factor * w
        metrics["icepop_masked_frac"] = masked_mean((w == 0).float(), mask)
        metrics["icepop_weight_mean"] = masked_mean(w, mask)
    if cfg.seq_correction is not None:
        w, keep, seq = sequence_weights(old, rollout, mask, cfg.seq_correction, cfg.seq_ratio,
                                        *cfg.seq_band, veto=cfg.seq_veto)
        factor = factor * w
        rows = mask.sum(-1) > 0  # sequences with trainable tokens
        if rows.any():
            metrics.update(seq_ratio_mean=float(seq[rows].mean()), seq_ratio_min=float(seq[rows].min()),
                           seq_ratio_max=float(seq[rows].max()),
                           seq_rejected_frac=float((~keep[rows]).float().mean()))
        metrics["seq_masked_token_frac"] = masked_mean((w == 0).float(), mask)
    metrics["correction_masked_frac"] = masked_mean((factor == 0).float(), mask)
    return per_token * factor
