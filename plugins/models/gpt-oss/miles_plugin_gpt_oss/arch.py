"""What miles needs to know about gpt-oss beyond transformers' own modules.

gpt-oss alternates sliding-window and full attention layers, with a learned sink per head
(transformers' ``DynamicSlidingWindowLayer`` cache keeps the window), and routes by top-k over
the router's logits (with a bias), then a softmax over just the chosen experts' logits. The megatron
trainer builds it from megatron-core's modules (``megatron_arch``).
"""
from __future__ import annotations

from typing import Any

import torch
from miles_tokens.routing import topk_softmax_weights


class GptOss:
    padded_batches = True

    def check_config(self, config: dict[str, Any]) -> list[str]:
        layers, types = config.get("num_hidden_layers"), config.get("layer_types")
        if layers is not None and types is not None and len(types) != layers:
            return [f"model.config.layer_types has {len(types)} entries; num_hidden_layers is {layers}"]
        if config.get("num_experts_per_tok", 4) > config.get("num_local_experts", 128):
            return ["model.config.num_experts_per_tok must be at most num_local_experts"]
        return []

    def megatron_arch(self, hf: Any) -> dict[str, Any]:
        """Grouped-query attention with biases, learned sinks and a sliding window on the
        ``sliding_attention`` layers, over experts with biases and a clamped SwiGLU
        (``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``), routed by top-k over
        the router's biased logits, then a softmax over the chosen."""
        from miles import MilesError

        if not getattr(hf, "attention_bias", True):
            raise MilesError("trainer megatron: gpt_oss with model.config.attention_bias: false is not supported "
                             "(megatron-core's add_bias_linear gives the attention output, the experts and the "
                             "router biases together)")
        kinds = set(hf.layer_types) - {"sliding_attention", "full_attention"}
        if kinds:
            raise MilesError(f"trainer megatron: model.config.layer_types {sorted(kinds)} are not supported "
                             f"(sliding_attention, full_attention)")
        sliding = tuple(i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention")
        if sliding and not hf.sliding_window:
            raise MilesError("trainer megatron: model.config.layer_types has sliding_attention layers but "
                             "sliding_window is not set")
        return dict(experts=hf.num_local_experts, topk=hf.num_experts_per_tok, moe_ffn=hf.intermediate_size,
                    norm_topk=True, qkv_bias=True, linear_bias=True, sinks=True,
                    window=hf.sliding_window if sliding else 0, window_layers=sliding,
                    glu_alpha=float(hf.swiglu_alpha), glu_limit=float(hf.swiglu_limit), glu_offset=1.0,
                    hf_router="router", hf_experts="interleaved")

    def routers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

        return [m for m in model.modules() if isinstance(m, GptOssTopKRouter)]

    def gate_weights(self, router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return topk_softmax_weights(logits, indices)
