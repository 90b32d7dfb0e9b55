"""What miles needs to know about the GLM MoE families beyond transformers' own modules.

GLM-4.5 to 4.7 and GLM-5 route like DeepSeek-V3: a sigmoid per expert plus a selection-only
bias, group-limited top-k, the chosen scores renormalised and scaled. GLM-5's DeepSeek sparse
attention picks each query's keys with an indexer's top-k over scores the attention mask sets to
-inf at padding, so a left-padded row picks the keys its unpadded forward picks (plus padding
where it has fewer keys than the top-k, which the mask still hides): padded batches are exact.
"""
from __future__ import annotations

from typing import Any

import torch
from miles_tokens.routing import score_weights, sigmoid_moe_megatron


def _group_problems(config: dict[str, Any]) -> list[str]:
    experts, groups = config.get("n_routed_experts", 128), config.get("n_group", 1)
    top_groups, top_k = config.get("topk_group", 1), config.get("num_experts_per_tok", 8)
    if experts % groups:
        return [f"model.config.n_routed_experts ({experts}) must be a multiple of n_group ({groups})"]
    if top_groups > groups:
        return [f"model.config.topk_group ({top_groups}) must be at most n_group ({groups})"]
    if top_k > experts // groups * top_groups:
        return [f"model.config.num_experts_per_tok ({top_k}) must be at most the experts of topk_group "
                f"groups ({experts // groups * top_groups})"]
    return []


class _SigmoidRouted:
    router_class = ""

    def check_config(self, config: dict[str, Any]) -> list[str]:
        return _group_problems(config)

    def routers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        from miles_mtp import outside_mtp

        return [m for m in outside_mtp(model) if type(m).__name__ == self.router_class]

    def gate_weights(self, router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return score_weights(logits.sigmoid(), indices, router.norm_topk_prob, router.routed_scaling_factor)


class Glm4Moe(_SigmoidRouted):
    padded_batches = True
    router_class = "Glm4MoeTopkRouter"

    def attach_mtp(self, model: torch.nn.Module, folder: str | None) -> list[torch.nn.Module]:
        """The checkpoint's MTP layers (``model.layers.<num_hidden_layers + k>``), kept beside the
        model, with their weights from ``folder`` (None: as initialised)."""
        from miles_mtp import attach_nextn, nextn_layer
        from transformers.models.glm4_moe import modeling_glm4_moe as m

        return attach_nextn(model, nextn_layer(m.Glm4MoeDecoderLayer, m.Glm4MoeRMSNorm), folder)

    def megatron_arch(self, hf: Any) -> dict[str, Any]:
        """Grouped-query attention (q/k norms optional, RoPE on a fraction of each head) over
        sigmoid-routed MoE with shared experts and dense first layers."""
        from miles import MilesError

        try:
            moe = sigmoid_moe_megatron(hf)
        except ValueError as e:
            raise MilesError(f"trainer megatron: {e}") from None
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        return dict(moe, qk_norm=bool(hf.use_qk_norm),
                    rotary_fraction=float(rope.get("partial_rotary_factor", 1.0)))


class GlmMoeDsa(_SigmoidRouted):
    padded_batches = True
    router_class = "GlmMoeDsaTopkRouter"

    def check_config(self, config: dict[str, Any]) -> list[str]:
        problems = _group_problems(config)
        layers = config.get("num_hidden_layers", 78)
        problems += [f"model.config.{key} has {len(config[key])} entries; num_hidden_layers is {layers}"
                     for key in ("layer_types", "mlp_layer_types", "indexer_types")
                     if key in config and len(config[key]) != layers]
        return problems

    def attach_mtp(self, model: torch.nn.Module, folder: str | None) -> list[torch.nn.Module]:
        """The checkpoint's MTP layers (``model.layers.<num_hidden_layers + k>``), kept beside the
        model, with their weights from ``folder`` (None: as initialised). transformers' layer reads
        its MoE and indexer kind from per-layer lists that end at ``num_hidden_layers``: each MTP
        layer is built over a config copy that extends them (MoE, its own indexer, as GLM-5's
        checkpoints hold them)."""
        import copy

        from miles_mtp import attach_nextn, nextn_layer
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

        class NextN(nextn_layer(m.GlmMoeDsaDecoderLayer, m.GlmMoeDsaRMSNorm)):
            def __init__(self, config: Any, layer_idx: int):
                config = copy.copy(config)
                for key, kind in (("mlp_layer_types", "sparse"), ("indexer_types", "full")):
                    kinds = getattr(config, key)
                    setattr(config, key, [*kinds, *[kind] * (layer_idx + 1 - len(kinds))])
                super().__init__(config, layer_idx)

        return attach_nextn(model, NextN, folder)

    def megatron_arch(self, hf: Any) -> dict[str, Any]:
        """DeepSeek-V3's multi-latent attention and sigmoid routing plus DeepSeek sparse attention's
        indexer (``megatron_dsa.py``)."""
        from .megatron_dsa import megatron_arch

        return megatron_arch(hf)

    def megatron_layer_spec(self, layer_spec: Any) -> Any:
        """The sparse core attention (transformers' indexer, attention over its chosen keys)."""
        from .megatron_dsa import layer_spec as edit

        return edit(layer_spec)
