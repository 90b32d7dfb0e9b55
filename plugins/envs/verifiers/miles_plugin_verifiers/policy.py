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
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def chat_tokenizer(chars: str) -> Any:
    from miles_tinypolicy import char_tokenizer

    return char_tokenizer(chars, CHAT_TEMPLATE)


def write_policy_folder(recipe: str, out: str, overrides: list[str] | None = None) -> Path:
    """Build the recipe's model (its ``model:`` section, the ``env.chars`` tokenizer) and save it
    with its tokenizer as a Hugging Face folder ``miles serve`` can load."""
    from miles import MilesError, make_plugin_manager
    from miles.config import apply_overrides, read_yaml

    data = apply_overrides(read_yaml(recipe), overrides or [])
    model = dict(data.get("model") or {})
    name = model.pop("name", None)
    pm = make_plugin_manager()
    if name not in pm.registry("model_specs"):
        raise MilesError(f"{recipe}: model.name {name!r} is not a registered model spec")
    comp = pm.registry("model_specs")[name]
    spec = pm.create("model_specs", name, comp.config(**model) if comp.config else model, pm=pm)
    chars = (data.get("env") or {}).get("chars") or "0123456789+="
    tok = spec.build_tokenizer(chat_tokenizer(chars))
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    spec.build_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write the model folder `miles serve` starts from")
    ap.add_argument("recipe")
    ap.add_argument("out")
    ap.add_argument("overrides", nargs="*", help="key=value, as for miles train")
    args = ap.parse_args(argv)
    print(write_policy_folder(args.recipe, args.out, args.overrides))


if __name__ == "__main__":
    main()
