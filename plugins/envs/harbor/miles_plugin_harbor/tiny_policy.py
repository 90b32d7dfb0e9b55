"""A tiny policy folder for ``miles serve`` and the Harbor agent: a random Qwen2 and a character
tokenizer over printable ASCII with a chat template, built locally (no download).
``python -m miles_plugin_harbor.tiny_policy DIR``.
"""
from __future__ import annotations

import argparse
import string
from pathlib import Path

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def char_tokenizer():
    """A fast tokenizer with one token per character of ``CHARS`` (newlines and spaces included)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab.update({c: 3 + i for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def write(folder: str | Path, seed: int = 0, context: int = 1024) -> Path:
    """Write the model and tokenizer to ``folder`` (created) and return it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    out = Path(folder)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(write(args.folder, args.seed))


if __name__ == "__main__":
    main()
