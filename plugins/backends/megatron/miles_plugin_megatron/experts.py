"""Routed experts as grouped GEMMs.

megatron-core's local (Transformer-Engine-free) layer spec computes routed experts with
``SequentialMLP``: one small MLP per local expert, about six GEMMs per expert, layer and step, plus
a host read of the token counts in every MoE layer. With dozens of experts that loop is most of a
training step's kernels. ``GroupedExperts`` keeps SequentialMLP's parameters, names and checkpoint
layout (conversion and checkpoints do not change) and computes each projection of all local
experts as one grouped GEMM (torch's ``grouped_mm``), inside megatron-core's own expert MLP
forward (activation, gated unit, clamps, per-token probabilities), so the math is the expert MLP's.

It falls back to the per-expert loop where a grouped GEMM cannot stand in for the linears: FP8 or
FP4 in megatron-core, probabilities applied to the input, linears whose forward was replaced (the
low-precision formats of ``lowp.py``), projection sizes the kernel cannot stride over, and on a GPU
anything but bfloat16 on compute capability 8.0 or newer; and, with a logged warning, for the rest of
the process once a grouped GEMM raises in a forward (a kernel the torch build or device lacks).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.transformer.moe.experts import SequentialMLP

# torch >= 2.10 names it publicly; CUDA runs it on compute capability 8.0 and up (its fast,
# sync-free kernel from 9.0), the CPU through its reference loop
_GMM = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
_log = logging.getLogger(__name__)


class _GroupedLinear(torch.autograd.Function):
    """``y[t] = x[t] @ W[e]^T`` for the tokens of expert ``e`` (tokens sorted by expert; ``offs``:
    cumulative counts), the weights passed one per expert. They are stacked for the GEMM and again
    in backward, so no stacked copy outlives the call (autograd would keep one per layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offs: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offs, *weights)
        return _GMM(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, offs, *weights = ctx.saved_tensors
        dy = dy.contiguous()  # the kernel takes no broadcast (zero-stride) gradient
        dx = _GMM(dy, torch.stack(weights), offs=offs) if ctx.needs_input_grad[0] else None
        dw: list = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            dw = list(_GMM(dy.t(), x, offs=offs).unbind(0))  # [E, out, in]
        return (dx, None, *dw)


class _Projection:
    """What the expert MLP's forward calls as ``linear_fc1`` / ``linear_fc2``: every local
    expert's linear at once, returning ``(output, bias)`` as megatron-core's linears do with
    ``skip_bias_add`` (the bias per token, from its expert)."""

    def __init__(self, linears: list, offs: torch.Tensor, owner: torch.Tensor, bias: bool):
        self.weights = [lin.weight for lin in linears]
        self.biases = [lin.bias for lin in linears] if bias and linears[0].bias is not None else None
        self.offs, self.owner = offs, owner

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        y = _GroupedLinear.apply(x, self.offs, *self.weights)
        return y, (torch.stack(self.biases)[self.owner] if self.biases is not None else None)


def _plain(lin: Any) -> bool:
    """A megatron-core linear computing ``x @ W^T`` by its own forward, bias returned apart."""
    own = vars(lin)
    return (isinstance(lin, (ColumnParallelLinear, RowParallelLinear)) and lin.skip_bias_add
            and "forward" not in own and not lin._forward_hooks and not lin._forward_pre_hooks
            and own.get("_forward_impl", linear_with_grad_accumulation_and_async_allreduce)
            is linear_with_grad_accumulation_and_async_allreduce)


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` whose forward runs the local experts as grouped GEMMs (module docstring)."""

    def _groupable(self, x: torch.Tensor) -> bool:
        c = self.config
        if c.fp8 or getattr(c, "fp4", None) or c.moe_apply_probs_on_input or x.dim() != 2 or not x.numel():
            return False
        if len(self.local_experts) < 2:
            return False
        # CUDA's grouped GEMM takes bfloat16 from compute capability 8.0
        cuda = x.device.type == "cuda"
        if cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0)):
            return False
        # the linears are fixed once built (low-precision formats replace theirs at build): checked
        # once per dtype, not in every MoE layer's every forward
        known = vars(self).setdefault("_grouping", {})
        if x.dtype not in known:
            linears = [lin for e in self.local_experts for lin in (e.linear_fc1, e.linear_fc2)]
            # the kernel strides rows in 16-byte steps: every projection size a multiple of that
            aligned = all(lin.weight.dtype == x.dtype and d * lin.weight.element_size() % 16 == 0
                          for lin in linears for d in lin.weight.shape)
            known[x.dtype] = aligned and all(_plain(lin) for lin in linears)
        return known[x.dtype]

    refused: str | None = None  # why the grouped GEMM failed in this process: the loop from then on

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        if GroupedExperts.refused is None and self._groupable(x):
            try:
                return self._grouped(x, tokens_per_expert, permuted_probs)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # a kernel this torch build or device lacks: the loop computes the same
                GroupedExperts.refused = str(e).splitlines()[0]
                _log.warning("megatron: grouped experts failed (%s); running megatron-core's per-expert loop",
                             GroupedExperts.refused)
        return super().forward(x, tokens_per_expert, permuted_probs)

    def _grouped(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        offs = counts.cumsum(0).to(torch.int32)
        owner = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
        first = self.local_experts[0]
        fc1 = _Projection([e.linear_fc1 for e in self.local_experts], offs, owner, bias=True)
        fc2 = _Projection([e.linear_fc2 for e in self.local_experts], offs, owner, bias=False)
        # the expert MLP's own forward (any megatron-core version's), its two linears swapped
        mlp = object.__new__(type(first))
        mlp.__dict__ = {**first.__dict__, "linear_fc1": fc1, "linear_fc2": fc2}
        out, _ = type(first).forward(mlp, x, per_token_scale=permuted_probs)
        if first.linear_fc2.bias is not None:  # what the expert MLP adds for its output bias
            bias = torch.stack([e.linear_fc2.bias for e in self.local_experts])[owner]
            out = out + (bias * permuted_probs.unsqueeze(-1)).to(out.dtype)
        return out, None
