"""A run's configuration as data: one YAML file plus ``key.sub=value`` overrides."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from miles import ConfigError


def read_yaml(path: str) -> dict[str, Any]:
    """The file's top-level mapping; a missing file, invalid YAML or another top level is a
    ``ConfigError`` naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"file {path} does not exist"], source=str(path))
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {e}"], source=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(["the top level must be a mapping of sections"], source=str(path))
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``a.b=value`` (value parsed as YAML, so numbers/bools/lists work)."""
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r} must look like key.sub=value")
            continue
        node, parts = data, key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.setdefault(part, {}), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = _scalar(value)
    if problems:
        raise ConfigError(problems, source="command line")
    return data


def _scalar(text: str) -> Any:
    """YAML parsing of an override value, plus the floats YAML 1.1 leaves as strings (2e-3)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value
