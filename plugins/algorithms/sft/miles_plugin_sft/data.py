"""SFT examples from a dataset file: prompt/response pairs or chat conversations, tokenized once.

A chat conversation is rendered with the tokenizer's chat template; the loss mask marks the
tokens of assistant turns only. Their character spans come from rendering growing prefixes of the
conversation (``messages[:i]`` with the generation prompt, then ``messages[:i + 1]``), and tokens
are mapped to spans with the fast tokenizer's offsets, so the whole text is tokenized in one piece
(no merges lost at turn boundaries).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles import MilesError, Sample, Task
from miles_tokens import encode_prompts

from .config import SFTConfig

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class Example:
    """One tokenized training example: ``loss_mask`` is per response token."""

    task: Task
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    response: str


def check_file(path: str) -> tuple[Path, str]:
    """The dataset file and its format, or a MilesError that says how to make it."""
    p = Path(path)
    if not p.is_file():
        raise MilesError(f"algorithm.data: {path} does not exist. For the arith env, write it with "
                         f"`python -m miles_plugin_arith.export_data {p.parent}` or set "
                         f"env.export_dir: {p.parent}")
    fmt = FORMATS.get(p.suffix)
    if fmt is None:
        raise MilesError(f"algorithm.data: {path} must end in one of {', '.join(FORMATS)}")
    return p, fmt


def load_rows(path: str) -> list[dict]:
    """Rows of a .jsonl/.json/.parquet file, read with Hugging Face ``datasets``."""
    p, fmt = check_file(path)
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.load_dataset(fmt, data_files=str(p), split="train")
    if len(ds) == 0:
        raise MilesError(f"algorithm.data: {path} has no rows")
    return ds.to_list()


def chat_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (each from the
    end of the generation prompt to the end of the turn, end-of-turn tokens included so the model
    learns to stop)."""
    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    text = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before, upto = render(messages[:i], True) if i else "", render(messages[:i + 1])
        if not (text.startswith(upto) and upto.startswith(before)):
            raise MilesError("the tokenizer's chat template does not render a conversation's prefix "
                             "as a prefix of the whole (it rewrites earlier turns), so assistant "
                             "tokens cannot be located; use prompt/response rows instead")
        spans.append((len(before), len(upto)))
    if not spans:
        raise MilesError("a chat row has no assistant message to train on")
    return text, spans


def chat_example(tokenizer: Any, messages: list[dict], label: Any = None) -> Example:
    """Prompt = the tokens before the first assistant token; loss on assistant tokens only."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise MilesError("chat rows (messages) need a tokenizer with a chat_template; give the "
                         "model spec a tokenizer that has one, or use prompt/response rows")
    text, spans = chat_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in offsets]
    first = mask.index(1) if 1 in mask else len(ids)
    if first == 0:
        raise MilesError("a chat row starts with an assistant turn: there is no prompt to condition on")
    last = next(m["content"] for m in reversed(messages) if m.get("role") == "assistant")
    opening = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    task = Task(prompt=messages[:opening], label=label)
    return Example(task, ids[:first], ids[first:], mask[first:], last)


def pair_examples(tokenizer: Any, prompts: list, responses: list[str], labels: list) -> list[Example]:
    """Prompt/response rows, encoded exactly as rollouts encode prompts (chat template for
    message lists, plain text otherwise) with the response and EOS as the target."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    p_ids = encode_prompts(tokenizer, prompts)
    r_ids = encode_prompts(tokenizer, list(responses))
    out = []
    for prompt, response, label, p, r in zip(prompts, responses, labels, p_ids, r_ids):
        if not p:
            raise MilesError(f"a data row has an empty prompt (response {response!r}); every "
                             f"example needs at least one prompt token to condition on")
        out.append(Example(Task(prompt=prompt, label=label), p, r + eos, [1] * (len(r) + len(eos)), response))
    return out


def tokenize(rows: list[dict], tokenizer: Any, cfg: SFTConfig, source: str) -> list[Example]:
    pairs = [r for r in rows if r.get(cfg.messages_key) is None]
    for r in pairs:
        if r.get(cfg.prompt_key) is None or r.get(cfg.response_key) is None:
            raise MilesError(f"{source}: a row has neither {cfg.messages_key!r} nor both "
                             f"{cfg.prompt_key!r} and {cfg.response_key!r} (keys: {sorted(r)}); set "
                             f"algorithm.prompt_key/response_key/messages_key to its column names")
    out = pair_examples(tokenizer, [r[cfg.prompt_key] for r in pairs], [r[cfg.response_key] for r in pairs],
                        [r.get(cfg.label_key) for r in pairs]) if pairs else []
    out += [chat_example(tokenizer, r[cfg.messages_key], r.get(cfg.label_key))
            for r in rows if r.get(cfg.messages_key) is not None]
    return out


class DatasetSource:
    """The examples of ``cfg.data``, read and tokenized on first use, drawn at random per step."""

    def __init__(self, cfg: SFTConfig):
        self.cfg = cfg
        self.examples: list[Example] | None = None
        check_file(cfg.data)  # when the run is built (after the env, which may write it), not mid-run

    def samples(self, tokenizer: Any, count: int, rng: random.Random, version: int = 0) -> list[Sample]:
        if self.examples is None:
            self.examples = tokenize(load_rows(self.cfg.data), tokenizer, self.cfg, self.cfg.data)
        picked = [rng.choice(self.examples) for _ in range(count)]
        # the reward of a labelled row is the env's to give (None lets the loop ask it); rows
        # without a label have no verifier answer to compare against, so they score 0
        return [Sample(task=e.task, prompt_ids=list(e.prompt_ids), response_ids=list(e.response_ids),
                       loss_mask=list(e.loss_mask), response=e.response, weight_version=version,
                       reward=None if e.task.label is not None else 0.0)
                for e in picked]
