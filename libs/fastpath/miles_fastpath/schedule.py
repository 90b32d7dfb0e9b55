"""The learning-rate schedule every trainer backend offers (linear warm-up, then constant,
cosine or linear decay) and the optimizer step that skips non-finite updates, one copy for fsdp2
and megatron."""
from __future__ import annotations

import math
from typing import Any, Callable


def lr_lambda(cfg: Any, total: int) -> Callable[[int], float]:
    """The LR multiplier at each optimizer step for ``LambdaLR``: linear warm-up over
    ``cfg.warmup_steps``, then ``cfg.schedule`` (constant | cosine | linear) decaying to
    ``cfg.min_lr_ratio`` by step ``total``."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or total <= cfg.warmup_steps:
            return 1.0
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay
    return f


def step_or_skip(optim: Any, sched: Any, totals: dict[str, float], loss_sum: float, norm: float) -> dict[str, float]:
    """The optimizer and LR steps after clipping (global gradient norm ``norm``), skipped on a
    NaN/inf loss or gradient: the norm is global, so every rank agrees, and the loop counts
    ``nonfinite_skipped`` steps (it stops after run.max_nonfinite_steps in a row). ``totals``
    gets the step's loss, grad_norm and lr."""
    totals.update(loss=loss_sum, grad_norm=norm, lr=sched.get_last_lr()[0])
    if math.isfinite(loss_sum) and math.isfinite(norm):
        optim.step()
        sched.step()
    else:
        totals["nonfinite_skipped"] = 1.0
    optim.zero_grad(set_to_none=True)
    return totals
