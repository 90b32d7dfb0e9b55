"""The learning-rate schedule every trainer backend offers (linear warm-up, then constant,
cosine or linear decay), one copy for fsdp2 and megatron."""
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
