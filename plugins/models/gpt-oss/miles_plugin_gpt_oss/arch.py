"""What miles needs to know about gpt-oss beyond transformers' own modules.

gpt-oss alternates sliding-window and full attention layers, with a learned sink per head
(transformers' ``DynamicSlidingWindowLayer`` cache keeps the window), and routes by top-k over
the router's logits (with a bias), then a softmax over just the chosen experts' logits.
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

    def routers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

        return [m for m in model.modules() if isinstance(m, GptOssTopKRouter)]

    def gate_weights(self, router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return topk_softmax_weights(logits, indices)
