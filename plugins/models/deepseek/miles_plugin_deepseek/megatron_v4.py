"""DeepSeek-V4 (``deepseek_v4``) in the megatron trainer: its ``Arch`` facts and a layer-spec edit
that holds transformers' own attention module inside megatron-core's layer.

The rest is the megatron trainer's: hyper-connections (``hc_mult`` residual streams around every
block, collapsed before the final norm), sqrt-softplus routing with a selection-only expert bias,
hash routing by a token-id table in the first MoE layers, one shared expert and the clamped SwiGLU
run in megatron-core's MoE layer from the ``Arch`` fields below.

The attention (shared-KV multi-query attention with per-head sinks, a sliding window, partial
interleaved RoPE undone on the output, a grouped low-rank output projection, and per layer type a
heavily compressed (HCA) or compressed sparse (CSA, a lightning indexer's top-k) branch over
windows of ``compress_rate`` tokens by absolute position) is ``DeepseekV4Attention`` itself, run
cache-less on ``[b, s, h]`` rows that start at position 0. Its weights keep their Hugging Face
names under ``self_attention.hf.``. At ``trainer.tensor_parallel`` > 1 its heads split over the TP
ranks in whole output groups (``o_groups``): each rank's module is transformers' own built for its
heads (``q_b_proj`` rows, sinks, ``o_a_proj`` groups, ``o_b_proj`` columns, ``SPLIT``), and its
outputs are summed over the ranks as a row-parallel projection's are. The parts all heads share
(the query and key down-projections, the compressor and its indexer) are whole on every rank and
run on the same hidden states; the trainer sums their gradients over the TP ranks (each rank's
covers its heads). Imported only for the megatron trainer.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule
from miles import MilesError

# the held module's weights split over TP ranks by head (each rank's heads are whole output groups),
# and their axis; the rest (shared by every head) is whole on each rank
SPLIT = {"hf.q_b_proj.weight": 0, "hf.sinks": 0, "hf.o_a_proj.weight": 0, "hf.o_b_proj.weight": 1}


def megatron_arch(hf: Any) -> dict[str, Any]:
    """The ``Arch`` fields of a ``deepseek_v4`` config; what neither megatron-core nor the held
    module computes is refused by key."""
    bad = []
    if getattr(hf, "hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {hf.hidden_act!r} (only silu)")
    if getattr(hf, "scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        bad.append(f"scoring_func {hf.scoring_func!r} (only sqrtsoftplus)")
    if getattr(hf, "mlp_bias", False):
        bad.append("mlp_bias: true (biases on the expert and shared-expert projections)")
    kinds = list(hf.mlp_layer_types)
    unknown = sorted(set(kinds) - {"hash_moe", "moe"})
    if unknown:
        bad.append(f"mlp_layer_types {unknown} (each layer must be hash_moe or moe)")
    if bad:
        raise MilesError(f"trainer megatron: deepseek_v4 with model.config {'; '.join(bad)} is not supported")
    return dict(experts=hf.n_routed_experts, topk=hf.num_experts_per_tok, moe_ffn=hf.moe_intermediate_size,
                norm_topk=True,  # transformers renormalises whatever norm_topk_prob says
                score="sqrtsoftplus", expert_bias=True, scaling=hf.routed_scaling_factor,
                # one shared expert of moe_intermediate_size (transformers' DeepseekV4MLP)
                shared_ffn=hf.moe_intermediate_size, glu_limit=float(hf.swiglu_limit),
                hash_layers=tuple(i for i, kind in enumerate(kinds) if kind == "hash_moe"),
                hc_mult=hf.hc_mult, hc_sinkhorn_iters=hf.hc_sinkhorn_iters, hc_eps=float(hf.hc_eps),
                hf_attention=True, kv_heads=1, head_dim=hf.head_dim, out_groups=hf.o_groups)


def layer_spec(spec: Any, hf: Any) -> Any:
    """``spec`` with ``HeldAttention`` (over ``hf``, the model's transformers config) as its
    self-attention."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec.submodules.self_attention = ModuleSpec(module=HeldAttention, params={"hf_config": hf})
    return spec


class HeldAttention(MegatronModule):
    """megatron-core's self-attention slot (``[s, b, h]`` in, ``(output, bias)`` out) around
    transformers' ``DeepseekV4Attention`` of this layer, with the rotary tables and sliding-window
    causal mask transformers' model hands it."""

    def __init__(self, config: Any, layer_number: int, hf_config: Any, **_: Any):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

        super().__init__(config=config)
        if config.context_parallel_size > 1 or config.sequence_parallel:
            raise MilesError("trainer megatron: DeepSeek-V4's attention runs on whole rows: no context or "
                             "sequence parallelism")
        hf_config = copy.copy(hf_config)
        hf_config._attn_implementation = "eager"  # the only one transformers offers for V4 (sinks, compressed keys)
        self.window, self.tp = hf_config.sliding_window, config.tensor_model_parallel_size
        mine = copy.copy(hf_config)  # this rank's heads (trainer.tensor_parallel divides both: check_layout)
        mine.num_attention_heads //= self.tp
        mine.o_groups //= self.tp
        self.hf = DeepseekV4Attention(mine, layer_number - 1).to(config.params_dtype)
        for name, p in self.hf.named_parameters():  # fp32 in transformers whatever the model's dtype
            if name.endswith(("sinks", "position_bias")) or "q_a_norm." in name or "kv_norm." in name:
                p.data = p.data.float()
        self.rotary = DeepseekV4RotaryEmbedding(hf_config)  # buffers only, none stored

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The head-split weights as TP-sharded tensors, so a checkpoint loads at another TP size."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, SPLIT,
                                                   sharded_offsets)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, *_: Any,
                packed_seq_params: Any = None, **__: Any) -> tuple[torch.Tensor, None]:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        if packed_seq_params is not None:
            raise MilesError("trainer megatron: DeepSeek-V4's attention does not take packed sequences")
        if self.tp > 1:
            hidden_states = _SumGradOverHeads.apply(hidden_states)
        x = hidden_states.transpose(0, 1)  # [b, s, h]
        b, s = x.shape[:2]
        pos = torch.arange(s, device=x.device).expand(b, s)
        tables = {kind: self.rotary(x, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        i = torch.arange(s, device=x.device)
        allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)
        mask = torch.zeros(s, s, dtype=x.dtype, device=x.device).masked_fill(~allowed, torch.finfo(x.dtype).min)
        out, _ = self.hf(x, position_embeddings=tables, position_ids=pos, attention_mask=mask.expand(b, 1, s, s))
        out = out.transpose(0, 1).contiguous()
        return (reduce_from_tensor_model_parallel_region(out) if self.tp > 1 else out), None


class _SumGradOverHeads(torch.autograd.Function):
    """Identity forward; backward: the input's gradient (each TP rank's covers its heads) summed over
    the TP ranks. As megatron-core's ``copy_to_tensor_model_parallel_region``, except that this one
    reduces a strided gradient (the transpose's) too: that one reduces a contiguous copy and drops it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
        return grad
