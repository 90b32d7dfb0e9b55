"""A tiny policy folder for ``miles serve`` and the Harbor agent: a random Qwen2 and a character
tokenizer over printable ASCII with a chat template, built locally (no download).
``python -m miles_plugin_harbor.tiny_policy DIR``.
"""
from __future__ import annotations

import string
from pathlib import Path

from miles_tinypolicy import policy_cli, write_policy

# newlines and spaces included: the agent's prompts are shell commands and their outputs
CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def write(folder: str | Path, seed: int = 0, context: int = 1024) -> Path:
    """Write the model (hidden 32, 2 layers, ``context`` positions) and tokenizer to ``folder`` and return it."""
    return write_policy(folder, CHARS, TEMPLATE, seed=seed, hidden=32, intermediate=64, context=context)


def main(argv: list[str] | None = None) -> None:
    policy_cli(write, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
