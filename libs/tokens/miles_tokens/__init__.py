"""Text <-> token ids for rollouts and supervised phases, on any Hugging Face-style tokenizer, and
token samples padded into a training batch (``batch``), with their recorded MoE routing
(``routing``)."""
from __future__ import annotations

from typing import Any

from .batch import pad_samples
from .routing import routed_experts_rows

__all__ = ["encode_prompts", "decode_batch", "pad_samples", "routed_experts_rows"]


def encode_prompts(tokenizer: Any, prompts: list) -> list[list[int]]:
    """Token ids of task prompts: chat messages through the chat template, text as is (an all-text
    batch in one tokenizer call)."""
    if all(isinstance(p, str) for p in prompts):
        return [list(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() is its keys
    return [list(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
            if isinstance(p, list) else list(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]


def decode_batch(tokenizer: Any, ids: list[list[int]], skip_special: bool = True) -> list[str]:
    """Texts of many responses; a fast tokenizer's Rust backend skips transformers' per-list
    conversions, which cost more than the decoding itself for short responses. ``skip_special``
    False keeps special tokens' text (e.g. each token's own name in an OpenAI log-prob entry)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch(ids, skip_special_tokens=skip_special)
    return tokenizer.batch_decode(ids, skip_special_tokens=skip_special)
