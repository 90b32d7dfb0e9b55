"""A tiny policy folder for ``miles serve``: a random Qwen2 and a character tokenizer with a chat
template, built locally (no download). ``python -m miles_plugin_nemo_gym.tiny_policy DIR``.

Texts have no spaces: this character tokenizer, saved next to a Qwen2 config, loads back as a
Qwen2 tokenizer whose byte-level pre-tokenizer drops them.
"""
from __future__ import annotations

import argparse
from pathlib import Path

CHARS = "0123456789+=[]abcdefghijklmnopqrstuvwxyz"
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def write(folder: str | Path, seed: int = 0) -> Path:
    """Write the model and tokenizer to ``folder`` (created) and return it."""
    import torch
    from miles.testing import char_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = char_tokenizer(CHARS)
    tok.chat_template = TEMPLATE
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
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
