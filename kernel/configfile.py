"""Reading config YAML safely: a duplicate key, a nesting deeper than ``MAX_DEPTH`` or a document
that expands (through aliases) to more than ``MAX_NODES`` values is an error naming its line,
before any Python object is built, so an alias bomb costs neither memory nor a huge message.
Floats follow YAML 1.2 (``1e-3`` is a number, as users expect, not the string PyYAML makes it).
"""
from __future__ import annotations

import re
from typing import Any

import yaml

MAX_DEPTH = 64  # a real config nests about five levels; PyYAML's recursive composer dies near 1,000
MAX_NODES = 1_000_000  # values after alias expansion (inline task lists of 100k entries still fit)
MAX_BYTES = 16 << 20  # config files are small; a larger one is a mistake (a dataset, a log)
MERGE = "tag:yaml.org,2002:merge"


class YAMLLimitError(yaml.YAMLError):
    """A document the loader refuses; ``str()`` names the line and the fix."""


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the checks above."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YAMLLimitError(f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep; "
                                     f"a config nests a few levels (sections, then keys)")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        size = _expanded_size(node, {})
        if size > MAX_NODES:
            raise YAMLLimitError(f"expands to {size:,} values through its aliases (*name), over the "
                                 f"limit of {MAX_NODES:,}; write the values out or use fewer aliases")
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE or not isinstance(key_node, yaml.ScalarNode):
                    continue  # keys a merge (<<: *base) brings may be overridden, as YAML allows
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise YAMLLimitError(f"line {line}: duplicate key {key!r} (first at line {seen[key]}); "
                                         f"the later one would silently replace the earlier: keep one")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: Any, memo: dict[int, int]) -> int:
    """Values under ``node`` counting every alias as a copy (memoised: aliases share node objects)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a recursive alias counts once, instead of looping
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(n, memo) for n in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    memo[id(node)] = size
    return size


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_text(text: str) -> Any:
    """``text`` parsed with ``ConfigLoader``; raises ``yaml.YAMLError`` (``YAMLLimitError`` for the
    checks above)."""
    if len(text) > MAX_BYTES:
        raise YAMLLimitError(f"is {len(text) >> 20} MiB; a config file holds at most {MAX_BYTES >> 20} MiB "
                             f"(point to data files instead of pasting them in)")
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader subclass)
