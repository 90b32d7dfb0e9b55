"""Tool calls in a model turn's text, in the formats ``rollout.tool_format`` names.

``hermes`` (Qwen, Hermes): ``<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>``;
``function_tag`` (Llama 3.1 custom tools): ``<function=calc>{"x": 1}</function>``. A turn may
hold several calls; each is parsed on its own, so one malformed call does not hide the others.
A turn with no opening tag at all is the model's answer.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One call as the model wrote it. ``error`` is set (and ``name`` may be empty) when the call
    could not be parsed; the rollout then answers with the error instead of running a tool."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str | None = None


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>]*)>(.*?)(</function>|$)", re.DOTALL)


def _arguments(raw) -> tuple[dict, str | None]:
    """Arguments as a dict; some models write them as a JSON string, which is accepted too."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return {}, "arguments are not valid JSON"
    if not isinstance(raw, dict):
        return {}, "arguments must be a JSON object"
    return raw, None


def parse_hermes(text: str) -> list[ToolCall]:
    calls = []
    for m in _HERMES.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            calls.append(ToolCall(error="unterminated tool call (no </tool_call>)"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            calls.append(ToolCall(error="invalid JSON in tool call"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(ToolCall(error='tool call needs a "name"'))
            continue
        args, err = _arguments(obj.get("arguments", obj.get("parameters", {})))
        calls.append(ToolCall(obj["name"], args, err))
    return calls


def parse_function_tag(text: str) -> list[ToolCall]:
    calls = []
    for m in _FUNCTION.finditer(text):
        name, body, closed = m.group(1).strip(), m.group(2), bool(m.group(3))
        if not closed:
            calls.append(ToolCall(name, error="unterminated tool call (no </function>)"))
        elif not name:
            calls.append(ToolCall(error="tool call needs a name: <function=NAME>"))
        else:
            args, err = _arguments(body)
            calls.append(ToolCall(name, args, err))
    return calls


PARSERS = {"hermes": parse_hermes, "function_tag": parse_function_tag}


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """Every tool call in ``text`` (in order), malformed ones with ``error`` set; ``[]``: an answer."""
    return PARSERS[fmt](text)
