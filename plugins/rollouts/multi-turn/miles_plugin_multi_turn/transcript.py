"""A multi-turn sample as readable text: prompt, each model turn with the tool calls parsed from
it, each tool result, the answer and the reward (``rollout.show``)."""
from __future__ import annotations

import json
from typing import Any

from .parsing import parse_tool_calls


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages
        return " | ".join(f"{m.get('role')}: {m.get('content')}" for m in prompt if isinstance(m, dict))
    return str(prompt)


def _indent(text: str) -> str:
    return text.replace("\n", "\n" + " " * 12)


def render(sample: Any, tool_format: str = "hermes", title: str = "") -> str:
    """Text of one sample made by the ``multi_turn`` rollout (its ``extensions["multi_turn"]``)."""
    ext = sample.extensions.get("multi_turn", {})
    status = getattr(sample.status, "value", sample.status)
    reward = "-" if sample.reward is None else f"{sample.reward:g}"
    lines = [f"--- trajectory {title} task {sample.task.id}: reward {reward}, {status}, "
             f"{ext.get('turns', 0)} turn(s), {ext.get('tool_calls', 0)} tool call(s)".replace("  ", " "),
             f"prompt:     {_indent(_prompt_text(sample.task.prompt))}"]
    messages = ext.get("messages", [])
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            lines.append(f"tool:       {_indent(m['content'])}")
            continue
        calls = parse_tool_calls(m["content"], tool_format)
        label = "answer:" if i == last and not calls else "assistant:"
        lines.append(f"{label:<12}{_indent(m['content'])}")
        for c in calls:
            what = f"error: {c.error}" if c.error else f"{c.name}({json.dumps(c.arguments)})"
            lines.append(f"  call:     {what}")
    return "\n".join(lines)
