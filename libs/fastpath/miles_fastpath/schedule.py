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


class Tally:
    """A step's loss and metrics summed over its micro-batches on the device, read back once at
    the end: a ``float(loss)`` per micro-batch would make the host wait for the GPU each time and
    leave the GPU idle while the next micro-batch's kernels are launched."""

    def __init__(self) -> None:
        self.loss: list[Any] = []
        self.metrics: dict[str, list[Any]] = {}
        self.weights: dict[str, list[float]] = {}

    def add(self, loss: Any, metrics: dict[str, Any], weight: float = 1.0) -> None:
        """``loss`` of one micro-batch (a tensor or a number); ``metrics`` scaled by ``weight``,
        its share of the step's rows."""
        self.loss.append(loss.detach() if hasattr(loss, "detach") else loss)
        for k, v in metrics.items():
            self.metrics.setdefault(k, []).append(v.detach() if hasattr(v, "detach") else v)
            self.weights.setdefault(k, []).append(weight)

    def result(self) -> tuple[dict[str, float], float]:
        """``(metric sums, loss sum)`` as floats: one copy to the host for all of them."""
        import torch

        keys = list(self.metrics)
        parts = [self.loss, *(self.metrics[k] for k in keys)]
        flat = [x for p in parts for x in p]
        if not flat:
            return {}, 0.0
        dev = next((x.device for x in flat if isinstance(x, torch.Tensor)), torch.device("cpu"))
        vals = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=dev).reshape(())
                            for x in flat]).tolist()
        loss, i = sum(vals[:len(self.loss)], 0.0), len(self.loss)
        totals = {}
        for k in keys:  # weighted on the host in float64, as the numbers were before
            n = len(self.metrics[k])
            totals[k] = sum((v * w for v, w in zip(vals[i:i + n], self.weights[k])), 0.0)
            i += n
        return totals, loss
