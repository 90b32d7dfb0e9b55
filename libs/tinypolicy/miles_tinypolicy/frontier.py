"""Tiny random models of the frontier families the model plugins describe (DeepSeek-V3/V4, GLM-4.5,
GLM-5, Qwen3.5 MoE, Qwen3-Next, gpt-oss): inline transformers configs small enough for CPU tests,
weights whose next-token distributions and routers are far from flat, and a Hugging Face folder
of one with a character tokenizer that ``miles serve`` loads."""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "frontier_config", "lively", "write_frontier_policy"]

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
               tie_word_embeddings=False)
_FAMILY: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        routed_scaling_factor=2.5),
    # a hash-routed MoE layer, then a learned one; heavily compressed, then compressed sparse attention
    "deepseek_v4": dict(moe_intermediate_size=32, num_key_value_heads=1, head_dim=32, q_lora_rank=24,
                        num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, qk_rope_head_dim=8,
                        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe", "moe"], sliding_window=8, o_groups=2, o_lora_rank=16,
                        index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2),
    "glm4_moe": dict(intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=2, n_routed_experts=8,
                     n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                     head_dim=16),
    # 16 indexer heads: with fewer, a key's ReLU'd scores are all 0 often enough that ties at 0 decide
    # the indexer's top-k, which then depends on how many keys the forward holds
    "glm_moe_dsa": dict(intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        head_dim=8, index_topk=6, index_head_dim=16, index_n_heads=16,
                        mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention"] * 2,
                        indexer_types=["full"] * 2),
    "qwen3_5_moe_text": dict(num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts_per_tok=2,
                             num_experts=8, layer_types=["linear_attention", "full_attention"]),
    "qwen3_next": dict(intermediate_size=128, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       num_experts_per_tok=2, num_experts=8, norm_topk_prob=True,
                       layer_types=["linear_attention", "full_attention"]),
    "gpt_oss": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, num_key_value_heads=2,
                    head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
}
FAMILIES: tuple[str, ...] = tuple(_FAMILY)


def frontier_config(family: str) -> dict[str, Any]:
    """``family``'s tiny inline config (``model_type`` included): 2 layers of hidden size 64, top-2
    of 8 experts; no ``vocab_size`` (a model spec sizes it from its tokenizer)."""
    if family not in _FAMILY:
        raise KeyError(f"{family!r} is not a frontier family; one of {', '.join(FAMILIES)}")
    return {"model_type": family, **_COMMON, **_FAMILY[family]}


def lively(model: Any, seed: int = 1) -> list[tuple[str, Any]]:
    """Random weights for ``model`` (name, tensor) with outputs far from uniform: the default
    init's std 0.02 makes every next-token distribution nearly flat and every router nearly tied,
    and near-ties make comparisons of greedy tokens or chosen experts fragile."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            out.append((name, torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5))
        elif name.endswith("bias") and "correction" not in name:
            out.append((name, torch.randn(p.shape, generator=g) * 0.1))
    return out


def write_frontier_policy(folder: str | Path, family: str, tokenizer: Any = None, *, seed: int = 1) -> Any:
    """A ``family`` model of ``frontier_config`` sized to ``tokenizer`` (``char_tokenizer()`` by
    default) with ``lively`` weights, saved with the tokenizer into ``folder``; returns the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import char_tokenizer

    tok = tokenizer if tokenizer is not None else char_tokenizer()
    kw = frontier_config(family)
    config = AutoConfig.for_model(kw.pop("model_type"), vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **kw)
    torch.manual_seed(seed)  # the parameters lively leaves alone (norms, biases of the routers)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(dict(lively(model, seed)), strict=False)
    g = torch.Generator().manual_seed(seed)
    for name, table in model.named_buffers():
        if name.endswith("tid2eid"):  # DeepSeek-V4's hash routing (zeros at init): distinct experts per token
            experts = config.n_routed_experts
            table.copy_(torch.stack([torch.randperm(experts, generator=g)[:table.shape[1]]
                                     for _ in range(table.shape[0])]))
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return model
