"""OpenAI-compatible routes of ``miles serve``: ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (the official ``openai`` client works against them unchanged).

Requests go through the same engine thread and batching as ``/generate`` (``scheduler.py``), and
the server's API-key and loopback rules apply to them. Every choice also carries the token ids the
engine generated (``token_ids``), the prompt's ids (``prompt_token_ids``) and the weight version,
as SGLang and vLLM return them, so an agent framework can drive the policy while the trainer keeps
token-level data. Log-probs are the engine's own (under ``log_softmax(logits / T)``, what the
trainer recomputes); ``top_logprobs`` come from one extra forward pass over prompt + completion.

Limits (``limits.ServerLimits``) apply as on ``/generate``: text to tokenize, samples per
request; large bodies are prepared off the event loop. A client's own chat template is refused
unless the server trusts them (``trust_request_chat_template``, as vLLM's flag), and then renders
in a separate process under time and memory budgets (``templates.py``).

Streaming: the engine generates a whole completion in one call, so the SSE chunks (one per token,
or one per tool-call reply) are sent when generation ends, not token by token as it runs.
Stop strings are applied to the finished text (the engine stops on token ids only): the
completion is cut after the first token whose text completes a stop string.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from miles_tokens import decode_batch
from pydantic import ValidationError

from .limits import (Prep, PromptTooLarge, ServerBusy, ServerLimits, check_samples, check_text_size,
                     check_token_ids)
from .openai_protocol import ChatBody, CompletionBody, OpenAIError
from .protocol import errors_text
from .scheduler import Item, Request, Scheduler
from .templates import TemplateRenderer
from .tool_calls import parse_tool_calls

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")  # what HF hands a template


@dataclass
class Choice:
    """One generated sequence after stop strings: its ids, log-probs and text."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    text: str
    finish: str
    version: int
    top: list[list[tuple[int, float]]] | None = None
    first: bool = True  # the first of its prompt's n choices (usage counts each prompt once)


def mount_openai_routes(app: FastAPI, engine: Any, scheduler: Scheduler, *, model_dir: str,
                        limits: ServerLimits | None = None, prep: Prep | None = None) -> None:
    """Add the ``/v1`` routes to ``app`` (``server.build_app``)."""
    api = OpenAIRoutes(engine, scheduler, model_dir, limits or ServerLimits(), prep or Prep())
    app.state.templates = api.templates  # server.serve stops its process
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)


def top_alternatives(engine: Any, rows: list[tuple[list[int], list[int]]], temperature: float,
                     k: int) -> list[list[list[tuple[int, float]]]]:
    """The ``k`` likeliest tokens (id, log-prob) at each generated position, from one forward pass
    per sequence at the sampling temperature (1 for greedy, as the engine scores greedy tokens).
    Runs on the engine thread."""
    import torch

    out = []
    with torch.inference_mode():
        for prompt, tokens in rows:
            if not tokens:
                out.append([])
                continue
            ids = torch.tensor([prompt + tokens], dtype=torch.long, device=engine.device)
            logits = engine.model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1].float()
            logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
            vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
            out.append([list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())])
    return out


class OpenAIRoutes:
    """The handlers; ``model_dir`` names the one model served (its path, or its folder's name)."""

    def __init__(self, engine: Any, scheduler: Scheduler, model_dir: str, limits: ServerLimits, prep: Prep):
        self.engine, self.scheduler, self.tokenizer = engine, scheduler, engine.tokenizer
        self.limits, self.prep = limits, prep
        self.templates = TemplateRenderer(limits.template_timeout_s, limits.template_memory_mb,
                                          limits.template_max_chars, limits.max_prompt_chars)
        cfg = engine.model.config
        self.vocab = int(getattr(cfg, "vocab_size", 0) or 0)
        self.context = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        self.model_id = str(model_dir)
        self.names = {self.model_id, Path(model_dir).name, str(Path(model_dir).resolve())}
        self.created = int(time.time())

    # -- routes ----------------------------------------------------------------------------------
    async def models(self):
        """The served model (OpenAI ``GET /v1/models``)."""
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                            "owned_by": "miles", "max_model_len": self.context}]}

    async def completions(self, request: HttpRequest):
        """OpenAI ``POST /v1/completions``."""
        def prepare():
            body = CompletionBody.model_validate(_json(raw))
            self._check_model(body.model)
            if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], str)):
                texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
                self._check_text(texts, "prompt")
            self._check_request(body.num_prompts, body)
            prompts = body.prompts(self.tokenizer)
            return body, prompts, self._max_new(body.max_tokens, prompts, 16)

        raw = await request.body()
        try:
            body, prompts, max_new = await self._prepare(len(raw), prepare)
            choices = await self._run(prompts, body, max_new, body.logprobs or 0, request)
        except OpenAIError as e:
            return _error(e)
        rid, want_lp = f"cmpl-{uuid.uuid4().hex}", body.logprobs is not None
        if body.stream:
            return _sse(self._completion_chunks(rid, choices, want_lp, body.include_usage))
        out = [{"index": i, "text": c.text, "finish_reason": c.finish,
                "logprobs": self._completion_logprobs(c) if want_lp else None, **_extra(c)}
               for i, c in enumerate(choices)]
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_id, "choices": out, "usage": _usage(choices)})

    async def chat(self, request: HttpRequest):
        """OpenAI ``POST /v1/chat/completions``, with Hermes-style tool calls (``tool_calls.py``)."""
        def prepare():
            body = ChatBody.model_validate(_json(raw))
            self._check_model(body.model)
            self._check_request(1, body)
            prompt = self._chat_prompt(body)
            return body, prompt, self._max_new(body.max_completion_tokens if body.max_completion_tokens
                                               is not None else body.max_tokens, [prompt], None)

        raw = await request.body()
        try:
            # a client template renders in its own process: wait for it on a prep thread
            body, prompt, max_new = await self._prepare(len(raw), prepare, b"chat_template" in raw)
            choices = await self._run([prompt], body, max_new,
                                      (body.top_logprobs or 0) if body.logprobs else 0, request)
        except OpenAIError as e:
            return _error(e)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        replies = [self._reply(c, body.parses_tools) for c in choices]
        if body.stream:
            return _sse(self._chat_chunks(rid, choices, replies, bool(body.logprobs), body.include_usage))
        out = [{"index": i, "message": {"role": "assistant", **msg}, "finish_reason": finish,
                "logprobs": {"content": self._chat_logprobs(c)} if body.logprobs else None, **_extra(c)}
               for i, (c, (msg, finish)) in enumerate(zip(choices, replies))]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                             "model": self.model_id, "choices": out, "usage": _usage(choices),
                             "prompt_token_ids": choices[0].prompt if choices else []})

    # -- requests --------------------------------------------------------------------------------
    async def _prepare(self, size: int, fn: Any, offload: bool = False) -> Any:
        """``fn()`` through ``Prep`` (off the loop for large bodies), its errors as OpenAI's."""
        try:
            return await self.prep.run(size, fn, offload)
        except ValidationError as e:
            raise OpenAIError(errors_text(e)) from None
        except PromptTooLarge as e:
            raise OpenAIError(str(e), 413, "prompt", "prompt_too_long") from None
        except ServerBusy as e:
            raise OpenAIError(str(e), 503) from None

    def _check_text(self, texts: list[str], param: str) -> None:
        try:
            check_text_size(texts, self.limits.max_prompt_chars, param)
        except PromptTooLarge as e:
            raise OpenAIError(str(e), 413, param, "prompt_too_long") from None

    def _check_request(self, prompts: int, body: Any) -> None:
        """The limits a body breaks before any tokenizing: samples, stop token ids."""
        try:
            check_samples(prompts * (body.n or 1), self.limits.max_samples_per_request)
        except ValueError as e:
            raise OpenAIError(str(e), param="n") from None
        try:
            check_token_ids(body.stop_token_ids or [], self.vocab, "stop_token_ids")
        except ValueError as e:
            raise OpenAIError(str(e), param="stop_token_ids") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise OpenAIError(f"The model '{model}' does not exist; this server serves '{self.model_id}' "
                              f"(GET /v1/models)", 404, "model", "model_not_found")

    def _chat_prompt(self, body: ChatBody) -> list[int]:
        messages = body.template_messages()
        self._check_text([m["content"] for m in messages if isinstance(m.get("content"), str)], "messages")
        kwargs = dict(body.chat_template_kwargs or {})
        source = kwargs.pop("chat_template", None) or body.chat_template
        if source is not None:
            text = self._client_template(source, messages, body, kwargs)
        else:
            text = self._model_template(messages, body, kwargs)
        self._check_text([text], "messages")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _model_template(self, messages: list[dict], body: ChatBody, kwargs: dict) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError("this model's tokenizer has no chat template (chat_template.jinja or "
                              "tokenizer_config.json 'chat_template'), so messages cannot be formatted; "
                              "send a prompt to /v1/completions instead, or add a template to the "
                              "model folder", param="messages")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=body.tools or None,
                                                      add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as e:  # a template error is the request's (e.g. raise_exception)
            raise OpenAIError(f"messages: the chat template failed: {type(e).__name__}: {e}",
                              param="messages") from e

    def _client_template(self, source: Any, messages: list[dict], body: ChatBody, kwargs: dict) -> str:
        if not self.limits.trust_request_chat_template:
            raise OpenAIError("chat_template: this server does not render templates sent by clients "
                              "(a template is a program); drop it to use the model's template, or start "
                              "the server with trust_request_chat_template=true", param="chat_template")
        special = {k: v for k in SPECIAL_TOKENS if isinstance(v := getattr(self.tokenizer, k, None), str)}
        context = {**special, **kwargs, "messages": messages, "tools": body.tools or None,
                   "add_generation_prompt": True}
        try:
            return self.templates.render(source, context)
        except ValueError as e:
            raise OpenAIError(str(e), param="chat_template") from None

    def _max_new(self, asked: int | None, prompts: list[list[int]], default: int | None) -> int:
        """``max_tokens`` checked against the context (default: all of the room left)."""
        longest = max(len(p) for p in prompts)
        bad = [t for p in prompts for t in p if not 0 <= t < self.vocab] if self.vocab else []
        if bad:
            raise OpenAIError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab})",
                              param="prompt")
        if longest == 0:
            raise OpenAIError("prompt: empty (need at least one token)", param="prompt")
        room = None if self.context is None else self.context - longest
        if room is not None and room < 1:
            raise OpenAIError(f"This model's maximum context length is {self.context} tokens; the prompt "
                              f"has {longest}, which leaves no room to generate", param="messages",
                              code="context_length_exceeded")
        if asked is None:
            asked = default if default is not None else (room if room is not None else 256)
        if room is not None and asked > room:
            raise OpenAIError(f"This model's maximum context length is {self.context} tokens; the prompt "
                              f"has {longest}, so max_tokens can be at most {max(room, 0)} (asked "
                              f"{asked})", param="max_tokens", code="context_length_exceeded")
        return asked

    async def _run(self, prompts: list[list[int]], body: Any, max_new: int, top_k: int,
                   request: HttpRequest) -> list[Choice]:
        """Generate ``n`` choices per prompt on the engine thread (ordered prompt by prompt). A
        client that disconnects cancels its request, so the engine stops working on it."""
        from .server import until_done_or_disconnected

        try:
            params, n = body.params(max_new), body.n or 1
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        loop = asyncio.get_running_loop()
        req = Request(rid=uuid.uuid4().hex, loop=loop, future=loop.create_future(),
                      items=[Item(tuple(p), params, n) for p in prompts], seeded=params.seed is not None)
        self.scheduler.submit(req)
        try:
            if not await until_done_or_disconnected(req.future, request):
                self.scheduler.cancel(req)  # nobody will read the answer
                raise OpenAIError("client disconnected", 499)
        except asyncio.CancelledError:
            self.scheduler.cancel(req)
            raise
        except OpenAIError:
            raise
        except Exception as e:  # the engine rejected the batch
            raise OpenAIError(f"generation failed: {type(e).__name__}: {e}", 500) from e
        if req.aborted:
            raise OpenAIError(f"the request was aborted: {req.aborted}", 503)
        choices = [self._finish(list(item.prompt), c, body.stops, j == 0)
                   for item in req.items for j, c in enumerate(item.completions)]
        if top_k:
            rows = [(c.prompt, c.tokens) for c in choices]
            tops = await self.scheduler.call(
                lambda: top_alternatives(self.engine, rows, params.temperature, top_k))
            for c, top in zip(choices, tops):
                c.top = top
        return choices

    def _finish(self, prompt: list[int], comp: Any, stops: list[str], first: bool) -> Choice:
        """The completion cut at its first stop string (after the token that completes it)."""
        tokens, lps = list(comp.token_ids), list(comp.logprobs)
        text = decode_batch(self.tokenizer, [tokens])[0]
        finish = comp.finish_reason
        if stops and any(s in text for s in stops):
            lo, hi = 1, len(tokens)  # the shortest prefix whose text holds a stop string
            while lo < hi:
                mid = (lo + hi) // 2
                if any(s in decode_batch(self.tokenizer, [tokens[:mid]])[0] for s in stops):
                    hi = mid
                else:
                    lo = mid + 1
            tokens, lps = tokens[:lo], lps[:lo]
            text = decode_batch(self.tokenizer, [tokens])[0]
            text, finish = text[:min(text.index(s) for s in stops if s in text)], "stop"
        return Choice(prompt, tokens, lps, text, finish, comp.weight_version, first=first)

    # -- responses -------------------------------------------------------------------------------
    def _reply(self, c: Choice, parse_tools: bool) -> tuple[dict, str]:
        """(message fields, finish_reason) of a chat choice."""
        if parse_tools:
            content, calls = parse_tool_calls(c.text)
            if calls:
                return {"content": content, "tool_calls": calls}, "tool_calls"
        return {"content": c.text}, c.finish

    def _token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (special tokens shown), as OpenAI's log-prob entries name them."""
        return decode_batch(self.tokenizer, [[t] for t in ids], skip_special=False)

    def _completion_logprobs(self, c: Choice) -> dict:
        texts = self._token_texts(c.tokens)
        offsets, pos = [], 0
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        top = None
        if c.top is not None:
            names = self._token_texts([i for row in c.top for i, _ in row])
            it = iter(names)
            top = [{next(it): lp for _, lp in row} for row in c.top]
        return {"tokens": texts, "token_logprobs": c.logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, c: Choice) -> list[dict]:
        texts = self._token_texts(c.tokens)
        names = iter(self._token_texts([i for row in c.top or [] for i, _ in row]))
        out = []
        for k, (t, lp) in enumerate(zip(texts, c.logprobs)):
            top = [(next(names), v) for _, v in c.top[k]] if c.top else []
            out.append({"token": t, "logprob": lp, "bytes": list(t.encode()),
                        "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in top]})
        return out

    def _deltas(self, c: Choice) -> list[str]:
        """The text each token adds: decoded in a window of a few tokens before it (linear in the
        length). A decode ending in U+FFFD holds an incomplete character: that token adds nothing
        and the one that completes it adds it whole. The pieces add up to ``c.text`` exactly."""
        def decode(ids: list[int]) -> str:
            return decode_batch(self.tokenizer, [ids])[0]

        ids, text, out, shown = c.tokens, c.text, [], 0
        anchor, base = 0, ""  # base: decode(ids[anchor:k]) for the next token k
        for k in range(len(ids)):
            cur = decode(ids[anchor:k + 1])
            if cur.endswith("\ufffd") and k < len(ids) - 1:
                out.append("")
                continue
            if cur.startswith(base):
                piece = cur[len(base):]
            else:  # the window changed how earlier tokens read: the whole prefix decides
                piece = decode(ids[:k + 1])[shown:]
            piece = piece[:max(len(text) - shown, 0)]  # a stop string may end the text early
            out.append(piece)
            shown += len(piece)
            anchor = max(anchor, k + 1 - 6)
            base = decode(ids[anchor:k + 1])
        if "".join(out) != text:  # (never seen) keep the stream consistent with the full answer
            out[-1:] = [text[len("".join(out[:-1])):]] if out else []
        return out

    def _completion_chunks(self, rid: str, choices: list[Choice], want_lp: bool, usage: bool):
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_id}
        for i, c in enumerate(choices):
            lp = self._completion_logprobs(c) if want_lp else None
            for k, delta in enumerate(self._deltas(c)):
                piece = ({key: v[k:k + 1] if isinstance(v, list) else v for key, v in lp.items()}
                         if lp else None)
                yield {**head, "choices": [{"index": i, "text": delta, "logprobs": piece,
                                            "finish_reason": None, "token_ids": [c.tokens[k]]}]}
            yield {**head, "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": c.finish,
                                        "token_ids": [], "prompt_token_ids": c.prompt,
                                        "weight_version": c.version}]}
        if usage:
            yield {**head, "choices": [], "usage": _usage(choices)}

    def _chat_chunks(self, rid: str, choices: list[Choice], replies: list[tuple[dict, str]],
                     want_lp: bool, usage: bool):
        head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_id}

        def chunk(i, delta, finish=None, **extra):
            return {**head, "choices": [{"index": i, "delta": delta, "finish_reason": finish, **extra}]}

        for i, (c, (msg, finish)) in enumerate(zip(choices, replies)):
            lps = self._chat_logprobs(c) if want_lp else None
            yield chunk(i, {"role": "assistant", "content": ""}, token_ids=[])
            if "tool_calls" in msg:  # one chunk: the calls are only known once the reply is parsed
                calls = [{"index": j, **call} for j, call in enumerate(msg["tool_calls"])]
                yield chunk(i, {"content": msg["content"], "tool_calls": calls}, token_ids=c.tokens,
                            logprobs={"content": lps} if lps is not None else None)
            else:
                for k, delta in enumerate(self._deltas(c)):
                    yield chunk(i, {"content": delta}, token_ids=[c.tokens[k]],
                                logprobs={"content": lps[k:k + 1]} if lps is not None else None)
            yield chunk(i, {}, finish, token_ids=[], prompt_token_ids=c.prompt, weight_version=c.version)
        if usage:
            yield {**head, "choices": [], "usage": _usage(choices)}


def _extra(c: Choice) -> dict:
    """The token-level fields SGLang/vLLM add to a choice."""
    return {"token_ids": c.tokens, "prompt_token_ids": c.prompt, "weight_version": c.version}


def _usage(choices: list[Choice]) -> dict:
    prompt = sum(len(c.prompt) for c in choices if c.first)
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _json(raw: bytes) -> dict:
    from .server import parse_json

    try:
        return parse_json(raw)
    except ValueError as e:
        raise OpenAIError(str(e)) from None


def _error(e: OpenAIError) -> JSONResponse:
    # a 503 (busy, or aborted by a pause) is worth retrying: clients such as openai's back off on it
    return JSONResponse(e.body(), status_code=e.status, headers={"Retry-After": "1"} if e.status == 503 else None)


def _sse(chunks) -> StreamingResponse:
    def events():
        for c in chunks:
            yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")
