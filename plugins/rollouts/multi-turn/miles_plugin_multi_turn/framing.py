"""How prompts and tool results become tokens.

With a chat template (``tokenizer.chat_template``), tool results are rendered as ``tool``
messages after an assistant turn and the tokens are what the template writes after the model's
end-of-turn token, through the generation prompt of the next assistant turn (e.g. Qwen's
``\\n<|im_start|>user\\n<tool_response>...</tool_response><|im_end|>\\n<|im_start|>assistant\\n``).
Without one, each result is ``rollout.tool_result_template`` with ``{output}`` filled in, and
the model continues right after it. Either way the model's own tokens are never re-tokenized:
only the frame is encoded and appended.
"""
from __future__ import annotations

from typing import Any, Sequence

from miles import MilesError

# a stand-in conversation whose rendering is cut off: only what follows it is the frame
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, prompt: Any, tools: Sequence[dict] | None, use_template: bool) -> list[int]:
    """A task prompt: chat messages through the chat template (offering ``tools``), text as is."""
    if isinstance(prompt, list):
        if not use_template:
            raise MilesError("a task prompt is a list of chat messages but the tokenizer has no chat "
                             "template (or rollout.chat_template is 'never'); give text prompts or a "
                             "tokenizer with a chat template")
        return list(tokenizer.apply_chat_template(prompt, tools=list(tools) or None, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def _template_frame(tokenizer: Any, outputs: list[str]) -> str:
    tool_msgs = [{"role": "tool", "content": o} for o in outputs]
    try:
        base = tokenizer.apply_chat_template(_BASE, tokenize=False)
        full = tokenizer.apply_chat_template(_BASE + tool_msgs, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template without a tool role raises its own error type
        raise MilesError(f"the tokenizer's chat template cannot render tool results ({e}); set "
                         f"rollout.chat_template: never to use rollout.tool_result_template") from e
    eos = getattr(tokenizer, "eos_token", None)
    cut = base.rfind(eos) + len(eos) if eos and eos in base else len(base)
    if not full.startswith(base[:cut]):
        raise MilesError("the tokenizer's chat template renders a conversation differently when tool "
                         "messages follow it; set rollout.chat_template: never")
    return full[cut:]


def tool_frame(tokenizer: Any, outputs: list[str], template: str, use_template: bool) -> list[int]:
    """The tokens that follow a model turn which made tool calls with these ``outputs``."""
    if use_template:
        text = _template_frame(tokenizer, outputs)
    else:
        text = "".join(template.replace("{output}", o) for o in outputs)
    return list(tokenizer.encode(text, add_special_tokens=False))
