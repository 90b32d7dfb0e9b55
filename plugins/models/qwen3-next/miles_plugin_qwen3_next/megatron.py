"""Qwen3-Next and Qwen3.5 MoE in the megatron trainer: its ``Arch`` facts and a layer-spec edit
that puts a gated DeltaNet into the layers the config marks ``linear_attention``.

megatron-core's own ``GatedDeltaNet`` needs flash-linear-attention's Triton kernels; this module
computes what transformers' Qwen3-Next layer computes (causal depthwise convolution, the chunked
gated delta rule of transformers' PyTorch reference, the gated RMSNorm) with the parameter names,
shapes and tensor-parallel layout of megatron-core's module, so weights convert to either. The
layers to build come from megatron-core's own config fields (``linear_attention_freq``,
``linear_*_heads`` / ``_dim``, ``linear_conv_kernel_dim``), which the trainer sets from the
``Arch``. Imported only for the megatron trainer (megatron-core is not a dependency otherwise).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from miles import MilesError


def megatron_arch(hf: Any) -> dict[str, Any]:
    """The ``Arch`` fields of a ``qwen3_next`` / ``qwen3_5_moe_text`` config."""
    bad = []
    if getattr(hf, "attention_bias", False):
        bad.append("attention_bias: true (biases on the gated q_proj and o_proj)")
    if getattr(hf, "hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {hf.hidden_act!r} (only silu)")
    if bad:
        raise MilesError(f"trainer megatron: model.config {'; '.join(bad)} is not supported")
    layers = hf.num_hidden_layers
    types = list(hf.layer_types)
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise MilesError(f"trainer megatron: model.config.layer_types must list linear_attention / "
                         f"full_attention for each of the {layers} layers (got {len(types)}, unknown {unknown})")
    experts = getattr(hf, "num_experts", 0) or 0
    # Qwen3-Next: a dense MLP where mlp_only_layers or decoder_sparse_step say so; Qwen3.5: every layer MoE
    sparse = getattr(hf, "decoder_sparse_step", 1) or 1
    only = set(getattr(hf, "mlp_only_layers", None) or ())
    dense = tuple(i for i in range(layers) if experts and (i in only or (i + 1) % sparse))
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    fields: dict[str, Any] = dict(
        qk_norm=True, zero_centered_norms=True, attention_gate=True,
        rotary_fraction=float(rope.get("partial_rotary_factor", 1.0)),
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        linear_key_heads=hf.linear_num_key_heads, linear_value_heads=hf.linear_num_value_heads,
        linear_key_dim=hf.linear_key_head_dim, linear_value_dim=hf.linear_value_head_dim,
        linear_conv=hf.linear_conv_kernel_dim, linear_grouped=hf.model_type == "qwen3_next")
    if experts:
        fields.update(experts=experts, topk=hf.num_experts_per_tok, moe_ffn=hf.moe_intermediate_size,
                      norm_topk=bool(getattr(hf, "norm_topk_prob", True)), score="softmax",
                      shared_ffn=hf.shared_expert_intermediate_size, shared_gate=True, shared_hf="shared_expert",
                      dense_layers=dense)
    return fields


def _submodules(entry: Any) -> Any:
    """The submodules of a layer-spec entry: a ``ModuleSpec`` (megatron-core 0.16) or a
    ``functools.partial(Module, submodules=...)`` (later releases)."""
    if isinstance(entry, functools.partial):
        return entry.keywords.get("submodules")
    return getattr(entry, "submodules", None)


def _build(entry: Any, *args: Any, **kwargs: Any) -> Any:
    from megatron.core.transformer.spec_utils import build_module

    if isinstance(entry, functools.partial):
        return entry(*args, **kwargs)
    return build_module(entry, *args, **kwargs)


def layer_spec(spec: Any) -> Any:
    """``spec`` whose self-attention is a gated DeltaNet in the layers megatron-core's config marks
    linear (``linear_attention_freq``), and the spec's own attention elsewhere. Its projections
    are the attention's linear classes (column-parallel in, row-parallel out)."""
    attention = spec.submodules.self_attention
    sub = _submodules(attention)
    column, row = sub.linear_qkv, sub.linear_proj

    class LinearOrSoftmaxAttention:
        def __new__(cls, config: Any, layer_number: int, **kwargs: Any) -> Any:
            pattern = config.linear_attention_freq
            if isinstance(pattern, list) and pattern[layer_number - 1]:  # megatron-core numbers from 1
                return GatedDeltaNet(config, column, row, layer_number, kwargs.get("pg_collection"))
            return _build(attention, config=config, layer_number=layer_number, **kwargs)

    spec.submodules.self_attention = LinearOrSoftmaxAttention
    return spec


@torch.compiler.disable
def chunk_gated_delta_rule(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' chunked gated delta rule, kept out of ``trainer.compile``: dynamo would unroll
    its Python loop over 64-token chunks and specialise on the chunk count, so each new length
    bucket would recompile the layer into a graph that grows with the length. The projections,
    convolution and gated norm around it still compile."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule(*args, **kwargs)


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm over one value head, then times SiLU of the output gate (transformers'
    ``Qwen3NextRMSNormGated``: normalised in fp32, weighted in the input dtype)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet linear attention on ``[s, b, hidden]``, returning ``(output, bias)`` as an
    attention module does. Weights (megatron-core's names): ``in_proj`` ``[q; k; v; z; b; a]``,
    ``conv1d`` over ``[q; k; v]``, ``dt_bias``, ``A_log``, ``out_norm``, ``out_proj``; with TP
    ranks each holds its key and value heads' slice of every part."""

    def __init__(self, config: Any, column: Any, row: Any, layer_number: int, pg_collection: Any = None):
        super().__init__(config)
        tp = config.tensor_model_parallel_size
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        if nv % nk:
            raise MilesError(f"model.config.linear_num_value_heads ({nv}) must be a multiple of "
                             f"linear_num_key_heads ({nk})")
        if nk % tp or nv % tp:
            raise MilesError(f"trainer.tensor_parallel={tp} must divide the DeltaNet's "
                             f"linear_num_key_heads ({nk}) and linear_num_value_heads ({nv}); lower it")
        self.layer_number, self.tp = layer_number, tp
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.nk, self.nv = nk // tp, nv // tp  # this rank's heads
        qk, v = self.nk * self.dk, self.nv * self.dv
        self.split = [2 * qk + v, v, self.nv, self.nv]  # conv input, gate z, b, a
        group = {"tp_group": pg_collection.tp} if pg_collection is not None else {}
        hidden, dtype = config.hidden_size, config.params_dtype
        self.in_proj = _build(column, hidden, (2 * nk * self.dk + 2 * nv * self.dv + 2 * nv), config=config,
                              init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
                              is_expert=False, tp_comm_buffer_name="fc1", **group)
        conv = 2 * qk + v
        self.conv1d = torch.nn.Conv1d(conv, conv, config.linear_conv_kernel_dim, groups=conv, bias=False,
                                      padding=config.linear_conv_kernel_dim - 1, dtype=dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.nv, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.zeros(self.nv, dtype=dtype))
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):  # split across TP ranks, as megatron-core marks it
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        self.out_norm = GatedRMSNorm(self.dv, config.layernorm_epsilon, dtype)
        self.out_proj = _build(row, nv * self.dv, hidden, config=config, init_method=config.output_layer_init_method,
                               bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False,
                               tp_comm_buffer_name="fc2", **group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None,
                           **kwargs: Any) -> dict[str, Any]:
        """megatron-core's ``GatedDeltaNet`` checkpoint layout: ``dt_bias``, ``A_log`` and ``conv1d``
        split across TP ranks, ``in_proj`` and ``conv1d`` stored part by part (query, key, value,
        ...), so a checkpoint written at one TP size loads at another."""
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

        try:  # megatron-core 0.19 keeps it with the other SSM helpers, 0.16 beside its GatedDeltaNet
            from megatron.core.ssm.utils import _split_tensor_factory
        except ImportError:
            from megatron.core.ssm.gated_delta_net import _split_tensor_factory

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata, **kwargs)
        for name in ("dt_bias", "A_log", "conv1d.weight"):  # the default treats own parameters as replicas
            sd[prefix + name] = make_tp_sharded_tensor_for_checkpoint(sd[prefix + name].data, prefix + name, 0,
                                                                      prepend_offsets=sharded_offsets)
        qk, v = self.nk * self.dk, self.nv * self.dv
        sd[prefix + "in_proj.weight"] = _split_tensor_factory(
            sd[prefix + "in_proj.weight"], [qk, qk, v, v, self.nv, self.nv], ["query", "key", "value", "z", "beta",
                                                                             "alpha"], 0)
        sd[prefix + "conv1d.weight"] = _split_tensor_factory(sd[prefix + "conv1d.weight"], [qk, qk, v],
                                                             ["query", "key", "value"], 0)
        return sd

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, **_: Any) -> tuple[torch.Tensor, Any]:
        s, b = hidden_states.shape[:2]
        mixed, _ = self.in_proj(hidden_states)
        qkv, z, beta, alpha = mixed.transpose(0, 1).split(self.split, dim=-1)  # [b, s, ...]
        # causal depthwise convolution: pad K-1 on both sides, keep the first s outputs
        qkv = F.silu(self.conv1d(qkv.transpose(1, 2))[..., :s]).transpose(1, 2)
        qk = self.nk * self.dk
        q, k, v = qkv.split([qk, qk, self.nv * self.dv], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)
        out, _ = chunk_gated_delta_rule(
            q.reshape(b, s, self.nk, self.dk), k.reshape(b, s, self.nk, self.dk), v.reshape(b, s, self.nv, self.dv),
            g=g, beta=beta.sigmoid(), initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
        out = self.out_norm(out, z.reshape(b, s, self.nv, self.dv))
        return self.out_proj(out.reshape(b, s, -1).transpose(0, 1).contiguous())
