"""Prompt files read with Hugging Face ``datasets`` and checked row by row into ``Task``s.

A problem in a file is one ``MilesError`` naming the file, the row (1-based, a jsonl file's line)
and the key, with how to fix it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from miles import MilesError, Task

from .config import DatasetConfig

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def read_rows(path: str, key: str) -> list[dict]:
    """The rows of one file (``key``: the config key that named it, for errors)."""
    p = Path(path)
    builder = BUILDERS.get(p.suffix.lower())
    if builder is None:
        raise MilesError(f"env.{key}: {path} is not a .jsonl, .json, .parquet or .arrow file; convert it to one")
    if not p.is_file():
        raise MilesError(f"env.{key}: {path} does not exist; give the path of a prompt file")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        ds = datasets.load_dataset(builder, data_files=str(p.resolve()), split="train")
    except Exception as e:  # the library's own parse errors: name the file, keep its reason
        reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
        cause = e.__cause__ or e.__context__
        if cause is not None and str(cause).strip():
            reason = f"{reason} ({str(cause).strip().splitlines()[-1][:300]})"
        raise MilesError(f"env.{key}: {path} cannot be read as {builder} rows: {reason}; every row must be an "
                         f"object with the same keys and each key one type in every row") from None
    return ds.to_list()


def field(row: dict, dotted: str) -> Any:
    """``row[a][b]`` for ``"a.b"``; ``KeyError`` when a part is missing."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def _plain(label: Any) -> bool:
    """Text, a number, or a list of them (several accepted answers)."""
    scalar = (str, int, float)
    return isinstance(label, scalar) or (isinstance(label, list) and all(isinstance(x, scalar) for x in label))


def _messages_problem(value: list) -> str | None:
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"message {i} is {str(m)[:80]!r}, not {{role: text, content: text}}"
    return None if value else "an empty list of messages"


def build_prompt(raw: Any, cfg: DatasetConfig, where: str) -> Any:
    """The task prompt: chat messages (``chat_template``) or text."""
    if isinstance(raw, str):
        text = cfg.prompt_template.replace("{prompt}", raw)
        if not cfg.chat_template:
            return f"{cfg.system_prompt}\n{text}" if cfg.system_prompt else text
        return ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + \
            [{"role": "user", "content": text}]
    if not cfg.chat_template:
        raise MilesError(f"{where}: key {cfg.prompt_key!r} holds chat messages but env.chat_template is false; "
                         f"set env.chat_template: true or give text prompts")
    msgs = [{"role": m["role"], "content": m["content"]} for m in raw]
    if cfg.system_prompt and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": cfg.system_prompt})
    return msgs


def row_task(row: dict, cfg: DatasetConfig, path: str, number: int) -> Task:
    """One row as a ``Task``: prompt, label, metadata (the other columns), id ``file:row``."""
    where = f"{path} row {number}"
    keys = ", ".join(row) or "none"
    try:
        raw = field(row, cfg.prompt_key)
    except KeyError:
        raise MilesError(f"{where}: no key {cfg.prompt_key!r} (env.prompt_key); the row's keys: {keys}") from None
    problem = None
    if isinstance(raw, list):
        problem = _messages_problem(raw)
    elif not isinstance(raw, str) or not raw.strip():
        problem = "empty text" if isinstance(raw, str) else f"{type(raw).__name__} {raw!r:.60}"
    if problem:
        raise MilesError(f"{where}: key {cfg.prompt_key!r} (env.prompt_key) must be text or a list of chat "
                         f"messages; it is {problem}")
    label = None
    if cfg.label_key is not None:
        try:
            label = field(row, cfg.label_key)
        except KeyError:
            raise MilesError(f"{where}: no key {cfg.label_key!r} (env.label_key); the row's keys: {keys}; "
                             f"set env.label_key to the answer column (null if the reward needs none)") from None
        if label is None:
            raise MilesError(f"{where}: key {cfg.label_key!r} (env.label_key) is missing or null; give every row "
                             f"an answer or drop the row")
        if cfg.reward != "code" and not _plain(label):  # code's label may hold its tests
            raise MilesError(f"{where}: key {cfg.label_key!r} (env.label_key) is {type(label).__name__} "
                             f"{label!r:.60}; the {cfg.reward} reward compares text or numbers (or a list of them)")
    top = {cfg.prompt_key.split(".")[0], (cfg.label_key or "").split(".")[0]}
    if cfg.metadata_keys is None:
        metadata = {k: v for k, v in row.items() if k not in top}
    else:
        missing = [k for k in cfg.metadata_keys if k not in row]
        if missing:
            raise MilesError(f"{where}: no key {missing[0]!r} (env.metadata_keys); the row's keys: {keys}")
        metadata = {k: row[k] for k in cfg.metadata_keys}
    return Task(prompt=build_prompt(raw, cfg, where), label=label, metadata=metadata,
                id=f"{Path(path).name}:{number}")


def load_tasks(paths: list[str], cfg: DatasetConfig, key: str) -> list[Task]:
    """Every row of ``paths`` as a task, in file order; an empty file list is an error."""
    tasks = []
    for path in paths:
        rows = read_rows(path, key)
        if not rows:
            raise MilesError(f"env.{key}: {path} has no rows; give a file with at least one prompt")
        tasks += [row_task(row, cfg, path, i) for i, row in enumerate(rows, 1)]
    return tasks
