"""The policy's tokenizer and the model folder ``miles serve`` starts from.

The worker's verifiers client talks chat completions, so the tokenizer carries a chat template;
it renders a conversation as its messages' text and nothing else, which keeps the tiny
character-level model's prompt exactly the task's ``a+b=``. The trainer builds its model from the
recipe's ``model:`` section and pushes its weights to ``miles serve`` before the first rollout,
so the folder only has to match the architecture and the tokenizer.

    python -m miles_plugin_verifiers.policy recipes/verifiers.yaml runs/verifiers-policy
    miles serve runs/verifiers-policy --port 30000
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

PROG = "python -m miles_plugin_verifiers.policy"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def chat_tokenizer(chars: str) -> Any:
    from miles_tinypolicy import char_tokenizer

    return char_tokenizer(chars, CHAT_TEMPLATE)


def write_policy_folder(recipe: str, out: str, overrides: list[str] | None = None) -> Path:
    """Build the recipe's model (its ``model:`` section, the ``env.chars`` tokenizer) and save it
    with its tokenizer as a Hugging Face folder ``miles serve`` can load."""
    from miles import MilesError, make_plugin_manager
    from miles.config import ConfigError, apply_overrides, read_yaml, validate_section

    data = apply_overrides(read_yaml(recipe), overrides or [])
    pm = make_plugin_manager()
    problems: list[str] = []  # model.* problems named as `miles train` names them
    name, settings = validate_section(pm, "model", data.get("model"), problems)
    if problems:
        raise ConfigError(problems, source=recipe)
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MilesError(f"OUT {out}: cannot create the folder ({e.strerror}); pass a folder path you can "
                         "write to") from None
    spec = pm.create("model_specs", name, settings, pm=pm)
    chars = (data.get("env") or {}).get("chars") or "0123456789+="
    tok = spec.build_tokenizer(chat_tokenizer(chars))
    spec.build_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    from miles import MilesError

    ap = argparse.ArgumentParser(prog=PROG, description="write the model folder `miles serve` starts from")
    ap.add_argument("recipe")
    ap.add_argument("out")
    ap.add_argument("overrides", nargs="*", help="key=value, as for miles train")
    args = ap.parse_args(argv)
    try:  # a missing recipe or a bad key is one line (exit 2), as `miles` reports it, not a traceback
        print(write_policy_folder(args.recipe, args.out, args.overrides))
    except MilesError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
