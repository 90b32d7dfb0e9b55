"""Hermes-style tool calls in generated text, as OpenAI's ``tool_calls``.

Qwen2.5/3, Hermes and many other chat templates ask the model to answer a tool call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A last call cut short by the end of
generation (no closing tag) still counts when its JSON is complete, as vLLM's hermes parser does.
"""
from __future__ import annotations

import json
import re
import uuid

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an assistant reply. ``content`` is the text outside the calls
    (None when empty). When any call is not a JSON object with a string ``name``, the reply is
    returned unchanged as content with no calls: a malformed call is the model's answer, which the
    client (or the reward) sees as text rather than losing it."""
    matches = list(TOOL_CALL.finditer(text))
    if not matches:
        return text, []
    calls = []
    for m in matches:
        try:
            obj = json.loads((m.group(1) if m.group(1) is not None else m.group(2)).strip())
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str)
                                   else json.dumps(args, ensure_ascii=False)}})
    content = TOOL_CALL.sub("", text).strip()
    return content or None, calls
