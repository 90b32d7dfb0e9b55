"""A tiny policy folder for ``miles serve``: a random Qwen2 and a character tokenizer with a chat
template, built locally (no download). ``python -m miles_plugin_nemo_gym.tiny_policy DIR``.

Texts have no spaces: this character tokenizer, saved next to a Qwen2 config, loads back as a
Qwen2 tokenizer whose byte-level pre-tokenizer drops them.
"""
from __future__ import annotations

from pathlib import Path

from miles_tinypolicy import policy_cli, write_policy

CHARS = "0123456789+=[]abcdefghijklmnopqrstuvwxyz"
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def write(folder: str | Path, seed: int = 0) -> Path:
    """Write the model (hidden 64, 2 layers, 64 positions) and tokenizer to ``folder`` and return it."""
    return write_policy(folder, CHARS, TEMPLATE, seed=seed, hidden=64, intermediate=256, context=64)


def main(argv: list[str] | None = None) -> None:
    policy_cli(write, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
