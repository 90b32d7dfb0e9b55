"""Small local policies, built without a download: a character-level Hugging Face tokenizer
(``char_tokenizer``) and a folder with a tiny random Qwen2 over it (``write_policy``) that
``miles serve`` loads. Env connectors tokenize with the first; their recipes and tests serve the
second. Nothing here imports pytest, so product code may use it."""
from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path
from typing import Any, Callable

__all__ = ["DEFAULT_CHARS", "char_tokenizer", "write_policy", "policy_cli"]

DEFAULT_CHARS = "0123456789+-*=() abcdefghijklmnopqrstuvwxyz"


def char_tokenizer(chars: str = DEFAULT_CHARS, chat_template: str | None = None, *, bos: bool = True) -> Any:
    """A real Hugging Face fast tokenizer with one token per character of ``chars`` after
    ``<pad>`` (0), ``<eos>`` (1) and ``<bos>`` (2); a character outside ``chars`` is ``<pad>``.
    ``bos=False`` leaves ``<bos>`` out, so the characters start at id 2 (the arith env's ids,
    which its checkpoints and recipes are sized for)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"pad_token": "<pad>", "eos_token": "<eos>", **({"bos_token": "<bos>"} if bos else {})}
    vocab = {name: i for i, name in enumerate(specials.values())}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    # [\s\S], not ".": the regex dot skips newlines, which would merge a run of them into one token
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    if chat_template is not None:
        hf.chat_template = chat_template
    return hf


def write_policy(folder: str | Path, chars: str, chat_template: str, *, seed: int = 0, hidden: int = 32,
                 intermediate: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 context: int = 128) -> Path:
    """Write a seeded random Qwen2 causal LM (tied embeddings, ``context`` positions) and its
    ``char_tokenizer(chars, chat_template)`` to ``folder`` (created) and return the folder."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(folder)
    if out.exists() and not out.is_dir():  # save_pretrained only logs this and writes nothing
        raise NotADirectoryError(errno.ENOTDIR, "a file, not a folder", str(out))
    tok = char_tokenizer(chars, chat_template)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def policy_cli(write: Callable[..., Path], description: str, argv: list[str] | None = None) -> None:
    """``FOLDER [--seed N]``: call ``write(folder, seed)`` and print the folder it wrote. A folder
    that cannot be written is a one-line usage error (exit 2), not a traceback."""
    spec = getattr(sys.modules.get(write.__module__), "__spec__", None)  # the module's name under -m too
    ap = argparse.ArgumentParser(prog=f"python -m {spec.name}" if spec else None, description=description)
    ap.add_argument("folder")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        print(write(args.folder, args.seed))
    except OSError as e:
        ap.exit(2, f"{ap.prog}: error: cannot write the policy folder {args.folder} "
                   f"({e.strerror or e}); pass FOLDER as a new or existing folder you can write to\n")
