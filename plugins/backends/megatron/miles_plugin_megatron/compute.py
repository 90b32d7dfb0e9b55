"""The bf16 copy of the policy that runs forward and backward, over the fp32 policy that the
optimizer, checkpoints and weight sync see (megatron's usual bf16 training: bf16 parameters and
activations, fp32 master weights and gradient sums).

Under autocast the fp32 weights are cast at every matmul and the residual stream, norms and rotary
embedding stay fp32, so a step spends much of its GPU time casting and moving fp32 activations.
Here every activation is bf16; each micro-batch's bf16 gradients are added into the fp32
parameters' ``.grad`` as soon as they are complete (the hook below), so gradient accumulation over
micro-batches keeps fp32 precision, and the copy is refreshed from the fp32 weights before the next
forward after they change (optimizer step, weight or checkpoint load).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch


class ComputeCopy:
    """``model()``: the copy, refreshed if the fp32 weights changed since (``stale()``)."""

    def __init__(self, master: torch.nn.Module, build: Callable[[], torch.nn.Module]):
        self.copy = build()
        names = [n for n, _ in master.named_parameters()]
        if names != [n for n, _ in self.copy.named_parameters()]:
            raise RuntimeError("compute copy: its parameters differ from the policy's")
        self.pairs = list(zip(master.parameters(), self.copy.parameters()))
        # persistent buffers steer the forward too (e.g. an MoE router's expert bias)
        mine, kept = dict(self.copy.named_buffers()), set(master.state_dict())
        self.buffers = [(b, mine[n]) for n, b in master.named_buffers() if n in kept and n in mine]
        for m, c in self.pairs:
            if c.requires_grad:
                c.register_post_accumulate_grad_hook(partial(_into, m))
        self.copy.train(master.training)
        self.copy_dtype = next(self.copy.parameters()).dtype
        self._stale = True

    def stale(self) -> None:
        """The fp32 weights changed: refresh before the next forward."""
        self._stale = True

    def model(self) -> torch.nn.Module:
        if self._stale:
            with torch.no_grad():
                torch._foreach_copy_([c for _, c in self.pairs], [m for m, _ in self.pairs])
                for m, c in self.buffers:
                    c.copy_(m)
            self._stale = False
        return self.copy


def _into(master: torch.nn.Parameter, p: torch.Tensor) -> None:
    """Move a finished micro-batch gradient of the copy into the fp32 parameter's sum."""
    if master.grad is None:
        master.grad = p.grad.to(master.dtype)
    else:
        master.grad.add_(p.grad)
    p.grad = None


