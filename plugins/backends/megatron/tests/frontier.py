"""Tiny DeepSeek-V3 and GLM-4.5 models (inline configs, random weights, a non-zero expert bias)
and a model spec over them that names its architecture, as the hf spec does, for the megatron
trainer's tests of families described by architecture plugins."""
from __future__ import annotations

from typing import Any

import helpers
import torch

_MOE = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "vocab_size": 101, "max_position_embeddings": 64}
CONFIGS: dict[str, dict[str, Any]] = {
    # multi-latent attention; 2 expert groups, one chosen per token (ranked by its 2 best experts)
    "deepseek_v3": {**_MOE, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 2,
                    "topk_group": 1, "rms_norm_eps": 1e-6, "routed_scaling_factor": 2.5},
    # grouped-query attention with q/k norms and biases, RoPE on half of each head
    "glm4_moe": {**_MOE, "num_key_value_heads": 2, "head_dim": 16, "n_group": 1, "topk_group": 1,
                 "rms_norm_eps": 1e-5, "routed_scaling_factor": 1.5, "attention_bias": True, "use_qk_norm": True},
}


def architecture(family: str) -> Any:
    if family == "deepseek_v3":
        from miles_plugin_deepseek.arch import DeepseekV3

        return DeepseekV3()
    from miles_plugin_glm.arch import Glm4Moe

    return Glm4Moe()


def hf_model(family: str, seed: int = 0, **over: Any) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**CONFIGS[family], **over}))
    architecture(family).attach_mtp(model, None)  # as the hf spec does: the MTP layer rides along
    with torch.no_grad():  # transformers starts the selection bias at zero: give it a say
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.1)
    return model.eval()


class Spec(helpers.Spec):
    """A model spec over an inline config that names its ``Architecture`` (``KnowsArchitecture``)."""

    def build_model(self, tokenizer: Any) -> torch.nn.Module:
        return hf_model(self.family, **self.over).train()

    def architecture(self) -> Any:
        return architecture(self.family)
