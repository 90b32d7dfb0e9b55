"""``trainer.precision: fp8 | mxfp8`` and ``trainer.qat: int4`` on megatron-core's linear layers,
with libs/lowp's numerics (``miles_lowp.linear``), without patching megatron-core.

Each ``ColumnParallelLinear`` / ``RowParallelLinear`` but the output head gets its own
``_forward_impl`` (the GEMM megatron-core's ``forward`` calls): the weight is cut into the Hugging
Face matrices it fuses (``linear_qkv``: q, k, v of each KV group; a gated ``linear_fc1``: gate, up)
so every block is the one the fsdp2 trainer and the engines round. Dense linears run
``lowp_linear`` (all three GEMMs in the format); experts round their weight only (the rounded
forward, the identity backward), as fsdp2 does for fused 3-D expert weights; INT4 QAT fake-quantizes
the weight (straight-through). Tensor-parallel shards are quantized on their own: that equals the
unsharded rounding exactly when every split of a matrix falls on a block boundary, which
``check_shards`` requires.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from miles import MilesError

from . import arch as arch_
from . import tp_train

BLOCKS = {"fp8": 128, "mxfp8": 32, "int4": 128}  # block edge along a split dimension


def fmt_of(precision: str, qat: str | None) -> str | None:
    """The format the linears compute in (None: full precision)."""
    return qat or (precision if precision in ("fp8", "mxfp8") else None)


def key_of(cfg: Any) -> str:
    return "trainer.qat" if cfg.qat else "trainer.precision"


def check_arch(cfg: Any, arch: Any) -> None:
    """Only layouts whose fused linears this module can cut into their HF matrices."""
    if cfg.qat and cfg.precision in ("fp8", "mxfp8"):
        raise MilesError(f"trainer.qat: {cfg.qat} with trainer.precision: {cfg.precision}: INT4 QAT trains "
                         f"over bf16 GEMMs; use trainer.precision: bf16 with trainer.qat, or drop trainer.qat")
    fmt = fmt_of(cfg.precision, cfg.qat)
    if fmt is None:
        return
    odd = [what for what, on in (("multi-latent attention", arch.kv_lora_rank > 0),
                                 ("gated attention", arch.attention_gate),
                                 ("linear attention layers", bool(arch.linear_layers)),
                                 ("a gated shared expert", arch.shared_gate),
                                 ("gpt-oss style experts", arch.glu_alpha is not None or arch.linear_bias),
                                 ("transformers' own attention module (DeepSeek-V4)", arch.hf_attention)) if on]
    if odd:
        raise MilesError(f"{key_of(cfg)}: {fmt} with trainer megatron covers standard attention and "
                         f"SwiGLU MLPs / experts; this model has {odd[0]}. Use trainer.name: fsdp2 for it, "
                         f"or {key_of(cfg)}: {'null' if cfg.qat else 'bf16'}")


def _parts(name: str, rows: int, arch: Any, tp: int) -> list[torch.Tensor] | None:
    """Row indices of the HF matrices a local weight of ``rows`` rows fuses (None: one matrix)."""
    if name.endswith("linear_qkv"):
        per, d = arch.heads // arch.kv_heads, arch.head_dim
        idx = torch.arange(rows).reshape(arch.kv_heads // tp, (per + 2) * d)
        return [idx[:, :per * d].reshape(-1), idx[:, per * d:(per + 1) * d].reshape(-1),
                idx[:, (per + 1) * d:].reshape(-1)]
    if name.endswith("linear_fc1"):  # [gate; up] on every shard
        idx = torch.arange(rows)
        return [idx[:rows // 2], idx[rows // 2:]]
    return None


def check_shards(key: str, fmt: str, name: str, weight: torch.Tensor, parts: list[torch.Tensor] | None,
                 column: bool, tp: int) -> None:
    """Per-shard blocks equal the unsharded ones when each split falls on a block edge: column
    parallel splits every fused matrix's rows (INT4 groups run along a row: any split), row
    parallel the input dimension."""
    if tp == 1:
        return
    block = BLOCKS[fmt]
    sizes = [len(p) for p in parts] if parts is not None else [weight.shape[0]]
    split = (sizes if fmt != "int4" else []) if column else [weight.shape[1]]
    bad = [s for s in split if s % block]
    if bad:
        raise MilesError(f"{key}: {fmt} with trainer.tensor_parallel: {tp} cuts {name} into shards of {bad[0]} "
                         f"rows/columns, not a multiple of its {block}-element blocks, so the shards would round "
                         f"differently from the whole weight the engines serve; use a tensor_parallel that "
                         f"splits it on {block}-element boundaries (or 1)")


def _impl(fmt: str, parts: tuple | None, expert: bool, input: torch.Tensor,
          weight: torch.Tensor, bias: torch.Tensor | None = None, allreduce_dgrad: bool = False,
          sequence_parallel: bool = False, tp_group: Any = None, **_: Any) -> torch.Tensor:
    """megatron-core's ``linear_with_grad_accumulation_and_async_allreduce`` in ``fmt``: the same
    input-gradient all-reduce (a column-parallel layer's; ``tp_train.copy_to_tp_region``, which
    also sums a strided gradient), no sequence parallelism. ``parts``: the fused matrices' row
    indices and the permutation back to the fused order."""
    from miles_lowp import int4 as i4
    from miles_lowp.linear import lowp_linear, rounded

    if sequence_parallel:
        raise MilesError("trainer.precision / trainer.qat: low-precision linears run without sequence parallelism")
    if allreduce_dgrad:
        input = tp_train.copy_to_tp_region(input, tp_group)
    if fmt == "int4":  # groups run along a row: the fused matrices need no cutting
        y = F.linear(input, i4.fake_int4(weight))
    elif expert:
        w = rounded(weight, fmt) if parts is None else torch.cat([rounded(weight[p], fmt) for p in parts[0]])[parts[1]]
        y = F.linear(input, w)
    elif parts is None:
        y = lowp_linear(input, weight, None, fmt)
    else:
        y = torch.cat([lowp_linear(input, weight[p], None, fmt) for p in parts[0]], -1)[..., parts[1]]
    return y if bias is None else y + bias.to(y.dtype)


def _one_rank_column(mod: Any, impl: Any, input_: torch.Tensor, weight: torch.Tensor | None = None,
                     runtime_gather_output: Any = None) -> tuple:
    weight = mod.weight if weight is None else weight
    y = impl(input=input_, weight=weight, bias=None if mod.skip_bias_add else mod.bias)
    return y, (mod.bias if mod.skip_bias_add else None)


def _one_rank_row(mod: Any, impl: Any, input_: torch.Tensor) -> tuple:
    if mod.skip_bias_add:
        return impl(input=input_, weight=mod.weight), mod.bias
    return impl(input=input_, weight=mod.weight, bias=mod.bias), None


def apply(model: torch.nn.Module, cfg: Any, arch: Any, tp: int) -> int:
    """Make ``model``'s linears (not the output head; with ``qat_scope: experts`` only the
    experts') compute in the config's format, in place; returns how many."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    fmt = fmt_of(cfg.precision, cfg.qat)
    if fmt is None:
        return 0
    etp = ps.get_expert_tensor_parallel_world_size() if arch.moe else 1
    one_rank = arch_.one_rank_linears()
    n = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) or name.endswith("output_layer"):
            continue
        expert = ".experts." in f".{name}."
        if cfg.qat and cfg.qat_scope == "experts" and not expert:
            continue
        column = isinstance(mod, ColumnParallelLinear)
        parts = _parts(name, mod.weight.shape[0], arch, tp) if column else None
        check_shards(key_of(cfg), fmt, name, mod.weight, parts, column, etp if expert else tp)
        if parts is not None:
            parts = ([p.to(mod.weight.device) for p in parts], torch.argsort(torch.cat(parts)).to(mod.weight.device))
        impl = functools.partial(_impl, fmt, parts, expert)
        mod._forward_impl = impl
        if isinstance(mod, one_rank):  # their forward is a plain F.linear: it gets the GEMM too
            mod.forward = functools.partial(_one_rank_column if column else _one_rank_row, mod, impl)
        n += 1
    return n


def formats(hf: torch.nn.Module, cfg: Any) -> dict[str, str]:
    """``{HF weight name: format}`` of the weights the forward rounds: libs/lowp's own choice on
    the Hugging Face model (the same set the fsdp2 trainer sends packed)."""
    from miles_lowp.linear import convert

    return convert(hf, cfg.precision, cfg.qat, cfg.qat_scope)
