"""A conversation kept as token ids: the served model's tokenizer (``tokenizer.json``, read with the
``tokenizers`` library) and chat template (rendered with jinja2, as Hugging Face renders it), with no
transformers and no torch, so it runs in Harbor's own virtualenv.

Only text that the model did not write is tokenized here: the first prompt and, per turn, the
template's text between the model's reply and the next generation prompt. The reply itself stays
the server's token ids.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# stands for the model's reply while the template renders the turn that follows it
REPLY = "\x00miles-reply\x00"


class ChatTokens:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer_dir {folder}: no tokenizer.json (save the served model's tokenizer "
                             f"there with tokenizer.save_pretrained)")
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        self.template = _template(folder, config)
        self.specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.added = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **{k: v for k, v in self.specials.items() if v is not None})

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt."""
        return self.encode(self.render(messages, True))

    def next_turn(self, messages: list[dict[str, Any]], message: dict[str, Any], reply_ids: list[int]) -> list[int]:
        """Token ids that follow the reply ``reply_ids`` (the last message of ``messages``, an
        assistant turn) up to the generation prompt after ``message``. A reply that ended on a
        special stop token (e.g. ``<|im_end|>``) already holds the template's end of turn."""
        text = self.render([*messages[:-1], {**messages[-1], "content": REPLY}, message], True)
        at = text.rfind(REPLY)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content as given")
        rest = text[at + len(REPLY):]
        last = self.tok.id_to_token(reply_ids[-1]) if reply_ids else None
        if last in self.added and rest.startswith(last):
            rest = rest[len(last):]
        return self.encode(rest)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _template(folder: Path, config: dict[str, Any]) -> Any:
    """The folder's chat template, compiled as transformers compiles it (sandboxed, trimmed blocks)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text()
    if isinstance(source, list):  # named templates: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise ValueError(f"tokenizer_dir {folder}: no chat template (chat_template.jinja or "
                         f"tokenizer_config.json's chat_template)")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
