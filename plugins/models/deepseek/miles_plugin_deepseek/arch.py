"""What miles needs to know about the DeepSeek families beyond transformers' own modules.

DeepSeek-V3 (and Kimi-K2, the same architecture) routes with a sigmoid per expert plus a
selection-only bias (``e_score_correction_bias``) and group-limited top-k; the chosen experts'
sigmoid scores are renormalised and scaled. DeepSeek-V4 scores with sqrt-softplus, has no groups,
and its first MoE layers route by a fixed token-id table (hash routing). Its attention compresses
the keys of each window of ``compress_rate`` tokens by absolute position and ignores the padding
mask, so rows of different lengths must not share a forward.
"""
from __future__ import annotations

from typing import Any

import torch
from miles_tokens.routing import score_weights, sigmoid_moe_megatron


class DeepseekV3:
    padded_batches = True

    def attach_mtp(self, model: torch.nn.Module, folder: str | None) -> list[torch.nn.Module]:
        """The checkpoint's MTP layers (``model.layers.<num_hidden_layers + k>``), kept beside the
        model, with their weights from ``folder`` (None: as initialised)."""
        from miles_mtp import attach_nextn, nextn_layer
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        return attach_nextn(model, nextn_layer(m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm), folder)

    def engine_attention(self, model: torch.nn.Module) -> int:
        """MLA decoding over the cached latent with ``kv_b_proj`` absorbed (``mla.py``)."""
        from .mla import absorb

        return absorb(model)

    def megatron_arch(self, hf: Any) -> dict[str, Any]:
        """Multi-latent attention (megatron-core's MLA modules) over sigmoid-routed MoE."""
        from miles import MilesError

        if not getattr(hf, "rope_interleave", True):
            raise MilesError("trainer megatron: rope_interleave: false is not supported (megatron-core's "
                             "MLA reads the rotary dimensions interleaved, as DeepSeek stores them)")
        try:
            moe = sigmoid_moe_megatron(hf)
        except ValueError as e:
            raise MilesError(f"trainer megatron: {e}") from None
        return dict(moe, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                    qk_nope_dim=hf.qk_nope_head_dim, qk_rope_dim=hf.qk_rope_head_dim,
                    v_head_dim=hf.v_head_dim, latent_eps=1e-6,  # DeepseekV3RMSNorm's default
                    head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim, kv_heads=hf.num_attention_heads)

    def check_config(self, config: dict[str, Any]) -> list[str]:
        experts, groups = config.get("n_routed_experts", 256), config.get("n_group", 8)
        top_groups, top_k = config.get("topk_group", 4), config.get("num_experts_per_tok", 8)
        problems = []
        if experts % groups:
            problems.append(f"model.config.n_routed_experts ({experts}) must be a multiple of n_group ({groups})")
        elif top_groups > groups:
            problems.append(f"model.config.topk_group ({top_groups}) must be at most n_group ({groups})")
        elif top_k > experts // groups * top_groups:
            problems.append(f"model.config.num_experts_per_tok ({top_k}) must be at most the experts of "
                            f"topk_group groups ({experts // groups * top_groups})")
        if config.get("qk_rope_head_dim", 64) % 2:
            problems.append("model.config.qk_rope_head_dim must be even (rotary embeddings)")
        return problems

    def routers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        from miles_mtp import outside_mtp

        return [m for m in outside_mtp(model) if isinstance(m, DeepseekV3TopkRouter)]

    def gate_weights(self, router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return score_weights(logits.sigmoid(), indices, router.norm_topk_prob, router.routed_scaling_factor)


class DeepseekV4:
    padded_batches = False
    _hf: Any = None  # the config megatron_arch read, for the layer-spec edit

    def megatron_arch(self, hf: Any) -> dict[str, Any]:
        """Hyper-connections, sqrt-softplus and hash routing in megatron-core's MoE layers, and
        transformers' own attention module held in each layer (``megatron_v4.py``)."""
        from .megatron_v4 import megatron_arch

        fields = megatron_arch(hf)
        self._hf = hf
        return fields

    def slot_layers(self, model: torch.nn.Module, step: Any, slots: int, max_len: int) -> list:
        """Its compressed attention in the engine's cache rows (``v4_slots.py``)."""
        from .v4_slots import slot_layers

        return slot_layers(model, step, slots, max_len)

    def megatron_layer_spec(self, layer_spec: Any) -> Any:
        """The held attention (``megatron_v4.HeldAttention``) in place of megatron-core's."""
        from miles import MilesError

        from .megatron_v4 import layer_spec as edit

        if self._hf is None:
            raise MilesError("trainer megatron: deepseek_v4's layer spec needs megatron_arch(config) first")
        return edit(layer_spec, self._hf)

    def check_config(self, config: dict[str, Any]) -> list[str]:
        layers = config.get("num_hidden_layers", 43)
        problems = [f"model.config.{key} has {len(config[key])} entries; num_hidden_layers is {layers}"
                    for key in ("layer_types", "mlp_layer_types") if key in config and len(config[key]) != layers]
        if config.get("num_experts_per_tok", 6) > config.get("n_routed_experts", 256):
            problems.append("model.config.num_experts_per_tok must be at most n_routed_experts")
        return problems

    def routers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter

        return [m for m in model.modules() if isinstance(m, (DeepseekV4TopKRouter, DeepseekV4HashRouter))]

    def gate_weights(self, router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        # hash layers too: the table picks the experts, the learned scores weigh them
        return score_weights(router.score_fn(logits), indices, True, router.routed_scaling_factor)
