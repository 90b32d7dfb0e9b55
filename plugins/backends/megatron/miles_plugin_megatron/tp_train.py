"""Training at tensor_parallel > 1 without sequence parallelism (which the trainer does not use):
every TP rank holds the whole ``[s, b, h]`` hidden states. Two megatron-core modules assume
sequence parallelism there, each fixed here on the built model (their weights, layout and
checkpoints unchanged):

* MoE layers: megatron-core raises in training (a performance guard). Its all-gather dispatcher
  then hands each expert shard every token ``tp`` times (an expert kept whole, at expert tensor
  parallel 1, sees them on each of the ``tp`` ranks). The forward is exact, and so are the
  gradients of the tokens and routers; each expert weight's gradient is ``tp`` times its own, which
  the trainer divides out when it reduces them (``MegatronTrainer._reduce_grads``).
* Multi-latent attention: the down-projection of the keys is column-parallel and its output is
  all-gathered, whose backward keeps this rank's columns of the gradient. The positional key
  (``k_pos_emb``, the last ``qk_pos_emb_head_dim`` columns) is shared by all heads, so each rank's
  gradient of it covers only its own heads; sequence parallelism sums those (its sequence gather's
  backward is a reduce-scatter), and here the gather's backward sums them over the TP ranks.

``copy_to_tp_region`` is the identity before a column-parallel GEMM whose backward sums the input's
gradient over the TP ranks, whatever its strides.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def unsplit_tokens(model: torch.nn.Module, arch: Any) -> None:
    """Fit ``model``'s MoE layers and multi-latent attention to TP > 1 without sequence parallelism."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mla = None
    if arch.mla:
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention as mla
    for m in model.modules():
        if isinstance(m, MoELayer):
            m.register_forward_pre_hook(_guard_off)
            m.register_forward_hook(_guard_on)
        elif mla is not None and isinstance(m, mla):
            group, rope = ps.get_tensor_model_parallel_group(), arch.qk_rope_dim

            def gathered(_module: Any, _args: Any, out: tuple, group: Any = group, rope: int = rope) -> tuple:
                return (_LatentGather.apply(out[0], rope, group), *out[1:])

            m.linear_kv_down_proj.register_forward_hook(gathered)


def _guard_off(module: torch.nn.Module, _args: Any) -> None:
    """megatron-core's guard alone reads the MoE layer's own ``training`` flag (its router and
    experts keep theirs): off for the forward."""
    module.train_after, module.training = module.training, False


def _guard_on(module: torch.nn.Module, _args: Any, _out: Any) -> None:
    module.training = module.train_after


class _LatentGather(torch.autograd.Function):
    """The column shards of the key down-projection's output, gathered (so megatron-core's MLA
    reads them as a whole output and gathers nothing); backward: the positional key's columns of
    the gradient summed over the TP ranks, then this rank's columns."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, rope: int, group: Any) -> torch.Tensor:
        ctx.rope, ctx.group, ctx.width = rope, group, shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        pos = grad[..., -ctx.rope:].contiguous()
        dist.all_reduce(pos, group=ctx.group)
        grad[..., -ctx.rope:] = pos
        start = dist.get_rank(group=ctx.group) * ctx.width
        return grad[..., start:start + ctx.width].contiguous(), None, None


def copy_to_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x``, whose gradient is summed over ``group`` in backward. megatron-core's
    ``copy_to_tensor_model_parallel_region`` all-reduces a contiguous copy of a strided gradient
    and returns the unreduced original; a GEMM may hand back such a gradient (a padded product's
    slice, e.g. a cuBLAS FP8 GEMM's for a width that is not a multiple of 16)."""
    return _SumGrad.apply(x, group) if dist.get_world_size(group) > 1 else x


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
