"""Request bodies of ``miles serve``'s OpenAI-compatible routes (``/v1/completions``,
``/v1/chat/completions``) and the errors they answer with.

Fields follow OpenAI's API reference; ``top_k`` and ``stop_token_ids`` are the vLLM/SGLang
extensions. Unknown fields are ignored (clients send newer fields freely, as vLLM accepts them),
but a known field whose value this engine cannot honour (penalties, ``logit_bias``, ``echo``,
a forced ``tool_choice``) is a 400 that names it, rather than an answer sampled differently.
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from miles import SamplingParams
from pydantic import BaseModel, ConfigDict, Field, model_validator

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               500: "server_error", 503: "server_error"}
INT64 = (-(2**63), 2**63 - 1)
TokenId = Annotated[int, Field(ge=0, le=INT64[1])]  # checked against the vocabulary later


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])  # a torch.Generator seed (as vLLM bounds it)
    stream: bool | None = False
    stream_options: dict | None = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # extension (vLLM, SGLang)
    stop_token_ids: list[TokenId] | None = None  # extension (vLLM, SGLang)

    @model_validator(mode="after")
    def _supported(self):
        bad = [name for name, ok in (
            ("presence_penalty", not self.presence_penalty), ("frequency_penalty", not self.frequency_penalty),
            ("logit_bias", not self.logit_bias)) if not ok]
        bad += self._unsupported()
        if bad:
            raise ValueError(f"not supported by miles serve: {', '.join(bad)}")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 sequences")
        return self

    def _unsupported(self) -> list[str]:
        return []

    @property
    def stops(self) -> list[str]:
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s]

    def params(self, max_new_tokens: int) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=max(self.top_k or 0, 0), max_new_tokens=max_new_tokens,
                              stop_token_ids=list(self.stop_token_ids or []), seed=self.seed)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(_Common):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids, or
    a list of such lists (one choice group of ``n`` per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def _unsupported(self) -> list[str]:
        return [name for name, ok in (
            ("echo=true", not self.echo), ("suffix", self.suffix is None),
            ("best_of (other than n)", self.best_of in (None, self.n or 1))) if not ok]

    @property
    def num_prompts(self) -> int:
        p = self.prompt
        return 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)

    def prompts(self, tokenizer: Any) -> list[list[int]]:
        p = self.prompt
        if isinstance(p, str):
            p = [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        if not p or any(isinstance(x, list) and not x for x in p):
            raise OpenAIError("prompt: must not be empty", param="prompt")
        return [list(x) if isinstance(x, list) else list(tokenizer.encode(x)) for x in p]


class ChatBody(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None  # extension (vLLM): e.g. {"enable_thinking": false}
    chat_template: str | None = None  # extension (vLLM): the client's own template (see templates.py)

    def _unsupported(self) -> list[str]:
        bad = []
        if self.tool_choice not in (None, "auto", "none"):
            bad.append(f"tool_choice={json.dumps(self.tool_choice)} (use 'auto' or 'none')")
        if self.response_format and self.response_format.get("type") != "text":
            bad.append("response_format (only {'type': 'text'})")
        if self.top_logprobs and not self.logprobs:
            bad.append("top_logprobs without logprobs=true")
        return bad

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def template_messages(self) -> list[dict]:
        """Messages as Hugging Face chat templates expect them: text parts joined into one string,
        tool-call arguments as objects (templates render them with ``tojson``)."""
        out = []
        for i, m in enumerate(self.messages):
            if not isinstance(m.get("role"), str):
                raise OpenAIError(f"messages[{i}]: needs a 'role'", param=f"messages[{i}].role")
            m = dict(m)
            if isinstance(m.get("content"), list):
                parts = m["content"]
                if any(not isinstance(p, dict) or p.get("type") != "text" for p in parts):
                    raise OpenAIError(f"messages[{i}].content: only text parts are supported",
                                      param=f"messages[{i}].content")
                m["content"] = "".join(p.get("text", "") for p in parts)
            if m.get("tool_calls"):
                m["tool_calls"] = [_call_with_object_arguments(c) for c in m["tool_calls"]]
            out.append(m)
        return out


def _call_with_object_arguments(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass  # the template renders the string as given
    return {**call, "function": fn}
