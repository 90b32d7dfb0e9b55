"""Text conditioning: a locally built word-level tokenizer and a CLIP text encoder."""
from __future__ import annotations

from typing import Any, Sequence

import torch

SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]  # ids 0-3; CLIP pools at the first [EOS]


def word_tokenizer(words: Sequence[str]) -> Any:
    """A ``PreTrainedTokenizerFast`` over ``words`` (whitespace-split, [BOS] ... [EOS])."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", vocab["[BOS]"]), ("[EOS]", vocab["[EOS]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   bos_token="[BOS]", eos_token="[EOS]")


def encode(tokenizer: Any, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids of each text, padded/truncated to ``max_length`` (the eos token kept)."""
    out = []
    for text in texts:
        ids = tokenizer(str(text))["input_ids"]
        if len(ids) > max_length:
            ids = ids[:max_length - 1] + [tokenizer.eos_token_id]
        out.append(ids + [tokenizer.pad_token_id] * (max_length - len(ids)))
    return out


def clip_encoder(tokenizer: Any, hidden: int, layers: int, max_length: int, seed: int,
                 token_scale: float = 10.0) -> torch.nn.Module:
    """A frozen, randomly initialised ``CLIPTextModelWithProjection`` sized for ``tokenizer``.
    Its token embeddings are drawn ``token_scale`` times wider than CLIP's default: at the default
    scale a random encoder's outputs are dominated by the positions and special tokens every prompt
    shares (cosine similarity above 0.9 between different colours), which starves the conditioning."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 16),
                         max_position_embeddings=max_length, projection_dim=hidden,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPTextModelWithProjection(cfg)
        with torch.no_grad():
            model.text_model.embeddings.token_embedding.weight.mul_(token_scale)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def embed(encoder: torch.nn.Module, ids: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token states ``[B, L, D]`` and the pooled projection ``[B, D]`` of ``ids`` ``[B, L]``."""
    out = encoder(input_ids=ids, attention_mask=(ids != pad_id).long())
    return out.last_hidden_state.float(), out.text_embeds.float()
