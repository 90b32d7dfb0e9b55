"""What miles needs to know about Qwen3-Next and Qwen3.5/3.6 MoE beyond transformers' own modules.

Both interleave gated DeltaNet linear attention (a convolution and a recurrent state per
sequence, held by transformers' ``LinearAttentionLayer`` cache; padding is masked before both)
with gated full attention, and route with a softmax over the experts, then top-k, renormalised
(Qwen3-Next when ``norm_topk_prob``, Qwen3.5 always) and cast back to the logits' dtype.
"""
from __future__ import annotations

from typing import Any

import torch
from miles_tokens.routing import softmax_topk_weights

ROUTERS = ("Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter")


class Qwen3Next:
    padded_batches = True

    def check_config(self, config: dict[str, Any]) -> list[str]:
        problems = []
        layers = config.get("num_hidden_layers")
        if layers is not None and "layer_types" in config and len(config["layer_types"]) != layers:
            problems.append(f"model.config.layer_types has {len(config['layer_types'])} entries; "
                            f"num_hidden_layers is {layers}")
        k, v = config.get("linear_num_key_heads", 16), config.get("linear_num_value_heads", 32)
        if v % k:
            problems.append(f"model.config.linear_num_value_heads ({v}) must be a multiple of "
                            f"linear_num_key_heads ({k})")
        return problems

    def routers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        from miles_mtp import outside_mtp

        return [m for m in outside_mtp(model) if type(m).__name__ in ROUTERS]

    def attach_mtp(self, model: torch.nn.Module, folder: str | None) -> list[torch.nn.Module]:
        """The checkpoint's MTP module (``mtp.*``: ``fc``, the two ``pre_fc_norm_*``, ``layers.<k>``
        of full attention over the mixture of experts, ``norm``; the config's ``mtp_num_hidden_layers``),
        kept beside the model, with its weights from ``folder`` (None: as initialised)."""
        from miles_mtp import attach_block

        if model.config.model_type == "qwen3_next":
            from transformers.models.qwen3_next import modeling_qwen3_next as m

            return attach_block(model, m.Qwen3NextDecoderLayer, m.Qwen3NextRMSNorm, folder)
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

        return attach_block(model, m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm, folder)

    def megatron_arch(self, hf: Any) -> dict[str, Any]:
        """Gated attention (partial RoPE, zero-centred q/k norms) and gated DeltaNet layers over
        softmax-routed MoE with a gated shared expert (``megatron.py``)."""
        from .megatron import megatron_arch

        return megatron_arch(hf)

    def megatron_layer_spec(self, layer_spec: Any) -> Any:
        """The DeltaNet module megatron-core builds without flash-linear-attention's kernels."""
        from .megatron import layer_spec as edit

        return edit(layer_spec)

    def gate_weights(self, router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        normalize = bool(getattr(router, "norm_topk_prob", True))  # Qwen3.5's router has no switch
        return softmax_topk_weights(logits, indices, normalize)
