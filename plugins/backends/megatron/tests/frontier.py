"""Tiny DeepSeek-V3, GLM-4.5, GLM-5 and gpt-oss models (inline configs, random weights, non-zero expert
biases and sinks) and a model spec over them that names its architecture, as the hf spec does, for
the megatron trainer's tests of families described by architecture plugins."""
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
    # biased attention with learned sinks, a 4-token window on the first layer, YaRN; biased experts
    # whose clamped SwiGLU clamps (limit 0.1) at these weights' scale; top-2 of 8 then a softmax
    "gpt_oss": {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                "vocab_size": 101, "max_position_embeddings": 64, "sliding_window": 4, "swiglu_limit": 0.1,
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}},
}
# GLM-5: DeepSeek-V3's attention and routing plus the sparse attention's indexer, which keeps 6 keys
# per query (rows of the DSA tests are longer); 16 indexer heads, so ReLU'd scores rarely tie at 0
CONFIGS["glm_moe_dsa"] = {**CONFIGS["deepseek_v3"], "rms_norm_eps": 1e-5, "index_topk": 6, "index_n_heads": 16,
                          "index_head_dim": 16, "num_nextn_predict_layers": 1}
# DeepSeek-V4: 2 hyper-connection streams; a heavily compressed (windows of 4), a compressed sparse
# (windows of 2, the indexer keeps 2 entries) and a sliding-window (4 tokens) attention layer; the
# first MoE layer hash-routed, top-2 of 8 sqrt-softplus-scored experts in the others; SwiGLU clamped
# at 0.5 (these weights' scale reaches it)
CONFIGS["deepseek_v4"] = {
    "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
    "q_lora_rank": 24, "qk_rope_head_dim": 8, "moe_intermediate_size": 32, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "vocab_size": 101, "max_position_embeddings": 64,
    "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"], "sliding_window": 4, "o_groups": 2, "o_lora_rank": 16,
    "index_n_heads": 4, "index_head_dim": 16, "index_topk": 2, "hc_mult": 2, "swiglu_limit": 0.5,
    "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}}
# the families without multi-token-prediction layers
NO_MTP = ("gpt_oss",)


# Qwen3-Next / Qwen3.5 MoE: gated DeltaNet layers (0, 2) around a gated-attention one (partial
# RoPE, GQA); top-2 of 8 experts, a gated shared expert; Qwen3-Next's first layer dense
_GATED = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 101, "max_position_embeddings": 64,
          "layer_types": ["linear_attention", "full_attention", "linear_attention"], "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
          "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}
CONFIGS["qwen3_next"] = {**_GATED, "mlp_only_layers": [0], "norm_topk_prob": False}
CONFIGS["qwen3_5_moe_text"] = dict(_GATED)
GATED = ("qwen3_next", "qwen3_5_moe_text")


def architecture(family: str) -> Any:
    if family in GATED:
        from miles_plugin_qwen3_next.arch import Qwen3Next

        return Qwen3Next()
    if family == "gpt_oss":
        from miles_plugin_gpt_oss.arch import GptOss

        return GptOss()
    if family == "glm_moe_dsa":
        from miles_plugin_glm.arch import GlmMoeDsa

        return GlmMoeDsa()
    if family == "deepseek_v3":
        from miles_plugin_deepseek.arch import DeepseekV3

        return DeepseekV3()
    if family == "deepseek_v4":
        from miles_plugin_deepseek.arch import DeepseekV4

        return DeepseekV4()
    from miles_plugin_glm.arch import Glm4Moe

    return Glm4Moe()


def hf_model(family: str, seed: int = 0, **over: Any) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**CONFIGS[family], **over}))
    if family in GATED:  # transformers starts the zero-centred norms at 0, the DeltaNet's at 1: move both
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "dt_bias")):
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
        return model.eval()
    if family == "deepseek_v4":
        return _v4_weights(model, seed)
    if family in NO_MTP:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():  # transformers starts the biases at zero, the sinks near it
            for name, p in model.named_parameters():
                if name.endswith(("_proj_bias", ".bias", "sinks")):
                    p.copy_(torch.randn(p.shape, generator=g) * (1.0 if name.endswith("sinks") else 0.1))
        return model.eval()
    architecture(family).attach_mtp(model, None)  # as the hf spec does: the MTP layer rides along
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # the indexer's key LayerNorm starts at the identity: move it
        for name, p in model.named_parameters():
            if ".indexer.k_norm." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    with torch.no_grad():  # transformers starts the selection bias at zero: give it a say
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.1)
    return model.eval()


def _v4_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """transformers starts DeepSeek-V4's sinks, position biases, hyper-connection biases and expert
    bias at zero and its token-id table at expert 0: give each a say (distinct experts per token)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                t.copy_(torch.rand(t.shape[0], 8, generator=g).argsort(-1)[:, :t.shape[1]])
            elif name.endswith(("sinks", "position_bias", "hc.base", "hc_base", "e_score_correction_bias")):
                t.add_(torch.randn(t.shape, generator=g) * 0.5)
    return model.eval()


def unpadded_logprobs(model: torch.nn.Module, b: Any) -> torch.Tensor:
    """transformers' ``[B, R]`` response log-probs, each row run alone and unpadded (DeepSeek-V4's
    compressors ignore the padding mask)."""
    out = torch.zeros(b.input_ids.shape[0], b.input_ids.shape[1] - b.prompt_len)
    for r, s in enumerate(b.samples):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
        out[r, :len(s.response_ids)] = logits.log_softmax(-1).gather(-1, ids[0, len(s.prompt_ids):, None])[:, 0]
    return out


class Spec(helpers.Spec):
    """A model spec over an inline config that names its ``Architecture`` (``KnowsArchitecture``)."""

    def build_model(self, tokenizer: Any) -> torch.nn.Module:
        return hf_model(self.family, **self.over).train()

    def architecture(self) -> Any:
        return architecture(self.family)


def moe_spec(family: str) -> Any:
    """The ``moe`` spec (routing replay on) over the hf spec of ``family``'s tiny config."""
    from miles import make_plugin_manager

    pm = make_plugin_manager()
    settings = pm.registry("model_specs")["moe"].config.model_validate(
        {"base": {"name": "hf", "config": {"model_type": family, **CONFIGS[family]}}, "routing_replay": True})
    return pm.create("model_specs", "moe", settings, pm=pm)


def check_replay(tr: Any, spec: Any, b: Any, layers: tuple[int, ...]) -> None:
    """R3 through the megatron trainer ``tr``: random recorded experts (top-2 of 8) of the MoE
    ``layers`` for every token but the last are the ones megatron-core's routers take, and the
    log-probs equal ``spec``'s replaying transformers forward (and differ from unreplayed ones)."""
    from replay_helpers import MegatronRouting, Tok, as_sets

    assert tr.replay is not None
    plain = tr.logprobs(b)
    g = torch.Generator().manual_seed(7)
    for s in b.samples:
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        s.extensions["moe"] = {"routed_experts": torch.rand(n, len(layers), 8, generator=g).argsort(-1)[..., :2].int()}
    hooks = MegatronRouting(tr.model, len(b))
    replayed = tr.logprobs(b)
    hooks.close()
    assert sorted(hooks.maps) == list(layers)
    for row, s in enumerate(b.samples):
        rec = s.extensions["moe"]["routed_experts"]
        for column, layer in enumerate(layers):
            assert torch.equal(hooks.maps[layer][row, :len(rec)], as_sets(rec[:, column], 8))
    hf = spec.build_model(Tok())
    hf.load_state_dict(dict(tr.named_weights()))
    mask = b.loss_mask.bool()
    assert (replayed - spec.action_logprobs(hf, b).detach())[mask].abs().max() < 1e-5
    assert (replayed - plain)[mask].abs().max() > 1e-3
