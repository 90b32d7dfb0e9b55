"""The critic's loss and its quality metric (PPO)."""
from __future__ import annotations

import torch


def value_clip_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                    clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss ``max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2)``
    (Miles' ``value_loss_function``, no 0.5 factor). ``clip=None`` gives plain ``(V - R)^2``.

    Returns ``(loss, clipped)``; ``clipped`` is True where the clipped term was the larger.
    """
    plain = (values - returns) ** 2
    if clip is None:
        return plain, torch.zeros_like(plain, dtype=torch.bool)
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (v_clip - returns) ** 2
    return torch.maximum(plain, clipped), clipped > plain


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over trainable tokens (population variances): 1 is a perfect
    critic, 0 a constant one; 0.0 when the returns do not vary."""
    n = mask.sum().clamp(min=1)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * mask).sum() / n
        return (((x - mean) * mask) ** 2).sum() / n

    vr = var(returns)
    return float(1 - var(returns - values) / vr) if vr > 0 else 0.0
