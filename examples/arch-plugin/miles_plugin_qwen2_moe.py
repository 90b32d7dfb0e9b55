"""miles architecture plugin: Qwen2-MoE (Hugging Face ``model_type`` ``qwen2_moe``), in one module.

transformers runs the model; what miles needs beyond it is this architecture's routers (routing
replay, R3) and its description for the megatron trainer. Qwen2-MoE routes with a softmax over the
experts, then top-k (renormalised when ``norm_topk_prob``), cast back to the logits' dtype, and
adds a shared expert scaled by a learned sigmoid gate per token. Registering imports no torch, so
``miles plugins`` stays fast.
"""
from __future__ import annotations

from typing import Any

from miles import hookimpl


@hookimpl
def miles_register_architectures(register: Any) -> None:
    register("qwen2_moe", lambda cfg=None, **_: Qwen2Moe())


class Qwen2Moe:
    """``Architecture``, ``RoutesExperts`` and ``BuildsMegatron`` (miles.protocols)."""

    padded_batches = True  # every layer honours the padding mask

    def check_config(self, config: dict[str, Any]) -> list[str]:
        experts, k = config.get("num_experts", 60), config.get("num_experts_per_tok", 4)
        if k > experts:
            return [f"model.config.num_experts_per_tok ({k}) must be at most num_experts ({experts})"]
        return []

    def routers(self, model: Any) -> list[Any]:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

        return [m for m in model.modules() if isinstance(m, Qwen2MoeTopKRouter)]

    def gate_weights(self, router: Any, logits: Any, indices: Any) -> Any:
        """The router's own operations (``Qwen2MoeTopKRouter.forward``) on the given experts."""
        import torch

        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype)

    def megatron_arch(self, hf: Any) -> dict[str, Any]:
        """Attention with QKV biases over softmax-routed experts and a gated shared expert; the
        layers ``mlp_only_layers`` / ``decoder_sparse_step`` leave dense."""
        from miles import MilesError

        if getattr(hf, "use_sliding_window", False):
            raise MilesError("trainer megatron: qwen2_moe with model.config.use_sliding_window: true is not "
                             "supported; set it to false or use trainer.name=fsdp2")
        layers, step = hf.num_hidden_layers, hf.decoder_sparse_step or 1
        only = set(hf.mlp_only_layers or ())
        return dict(experts=hf.num_experts, topk=hf.num_experts_per_tok, moe_ffn=hf.moe_intermediate_size,
                    norm_topk=bool(hf.norm_topk_prob), score="softmax", qkv_bias=bool(hf.qkv_bias),
                    shared_ffn=hf.shared_expert_intermediate_size, shared_gate=True, shared_hf="shared_expert",
                    dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step))
