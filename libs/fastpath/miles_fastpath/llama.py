"""The Llama-family layout check shared by the hand-written fast paths of the torch engine
(decode) and the fsdp2 trainer (log-probs): both run their own forward only on a model whose
layout they can reproduce exactly, and both must agree on what that is."""
from __future__ import annotations

from typing import Any

LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def llama_layout_problem(model: Any, architectures: tuple[str, ...]) -> str | None:
    """Why ``model`` is not a plain Hugging Face Llama-family decoder that a hand-written forward
    (the engine's and the trainer's fast paths) can run exactly as its own forward would; None
    when it is. ``architectures``: the exact class names the caller supports (a wrapper class,
    e.g. FSDP2's, or peft's LoRA layers are refused)."""
    import torch

    def sub(module: Any, dotted: str) -> Any:
        for part in dotted.split("."):
            module = getattr(module, part, None)
        return module

    def rms(m: Any) -> bool:
        return isinstance(m, torch.nn.Module) and hasattr(m, "weight") and hasattr(m, "variance_epsilon")

    name = type(model).__name__
    if name not in architectures:
        return f"{name} is not one of {', '.join(architectures)}"
    cfg, inner = model.config, getattr(model, "model", None)
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act={cfg.hidden_act!r} (only silu)"
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        return "RoPE that changes with sequence length (dynamic/longrope) or no rotary_emb module"
    window = getattr(cfg, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or ["sliding_attention"])
    if window is not None and sliding and window < cfg.max_position_embeddings:
        return f"sliding-window attention (sliding_window={window})"
    if type(model.lm_head) is not torch.nn.Linear or model.lm_head.bias is not None:
        return "lm_head is not a plain bias-free nn.Linear"
    if type(inner.embed_tokens) is not torch.nn.Embedding or not rms(inner.norm):
        return "embed_tokens / norm are not plain modules"
    for i, layer in enumerate(inner.layers):
        for lin in LLAMA_LINEARS:  # e.g. peft's LoRA wrappers would be silently skipped otherwise
            if type(sub(layer, lin)) is not torch.nn.Linear:
                return f"layers.{i}.{lin} is {type(sub(layer, lin)).__name__}, not nn.Linear"
        if not (rms(layer.input_layernorm) and rms(layer.post_attention_layernorm)):
            return f"layers.{i} norms are not RMSNorm"
    return None

