"""Limits ``miles serve`` puts on what a client may ask: the server's own settings
(``ServerLimits``), prompt lengths against the model's context, the samples one request may
queue, the folders a disk weight update may read, and request preparation (JSON parsing,
tokenization, chat templates) moved off the event loop when it is large."""
from __future__ import annotations

import asyncio
import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, TypeVar

from miles import MilesError, SamplingParams
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

T = TypeVar("T")
MAX_SAMPLES_PER_REQUEST = 4096  # prompts x n of one request, on /generate and /v1 alike
GROUP_JOIN_TIMEOUT_S = 600.0
INLINE_BODY_BYTES = 16 * 1024  # smaller bodies parse and tokenize in a few milliseconds at most


class ServerLimits(BaseModel):
    """The server's own ``key=value`` settings of ``miles serve`` (the rest are engine settings).
    Defaults follow what vLLM and SGLang servers do where they bound the same thing."""

    model_config = ConfigDict(extra="forbid")

    max_body_mb: float = Field(8.0, gt=0, le=4096, description="request bodies over this get a 413")
    body_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="a request body not received whole within this gets a 408 "
        "(the API key is checked before any of it is read)")
    max_prompt_chars: int = Field(
        1_048_576, ge=1, description="characters of text one request may ask to tokenize (prompts, "
        "chat messages, a rendered chat template); more gets a 413")
    max_samples_per_request: int = Field(
        MAX_SAMPLES_PER_REQUEST, ge=1, description="prompts x n of one request, on /generate and /v1 "
        "alike; more gets a 400")
    admit_samples: Optional[int] = Field(
        None, ge=1, description="samples taken into one engine call, shared fairly among the queued "
        "requests, so a small request waits for one such call at most behind a huge one; unset: the "
        "engine's max_batch_size")
    trust_request_chat_template: bool = Field(
        False, description="accept chat_template_kwargs.chat_template from clients (vLLM's "
        "--trust-request-chat-template); it then renders in a separate process under the budgets below")
    template_timeout_s: float = Field(5.0, gt=0, le=300, description="time budget of a client template")
    template_memory_mb: int = Field(512, ge=64, le=65536, description="address-space budget of the "
                                    "process that renders client templates")
    template_max_chars: int = Field(65536, ge=1, description="size of a client template's source")
    group_connect_timeout_s: float = Field(
        10.0, gt=0, le=600, description="/init_weights_update_group: the trainer's store must accept a "
        "connection within this (a dead address fails then, not after the join timeout)")
    group_join_timeout_s: float = Field(GROUP_JOIN_TIMEOUT_S, gt=0, le=86400,
                                        description="/init_weights_update_group: every rank joined")
    weights_dirs: Optional[list[str]] = Field(
        None, description="weights_dir=DIR[:DIR]: the only folders /update_weights_from_disk may read "
        "(unset: any; shards are safetensors in every case)")

    @field_validator("weights_dirs", mode="before")
    @classmethod
    def _dirs(cls, v: Any) -> Any:
        if v is None:
            return v
        roots = [str(d) for d in (v if isinstance(v, list) else str(v).split(os.pathsep)) if d]
        if not roots:
            raise ValueError("no folder given; give the folder(s) weight updates are written to")
        return [os.path.realpath(d) for d in roots]


def server_settings(settings: dict, host: str = "127.0.0.1") -> dict:
    """Take ``ServerLimits``' keys (``weights_dir`` for ``weights_dirs``) out of ``settings``;
    the validated values, or a MilesError naming each bad key and what it takes."""
    raw = {k: settings.pop(k) for k in list(settings) if k in ServerLimits.model_fields}
    if "weights_dir" in settings:
        raw["weights_dirs"] = settings.pop("weights_dir")
    try:
        out = ServerLimits(**raw).model_dump(exclude_unset=True)
    except ValidationError as e:
        bad = []
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"]).replace("weights_dirs", "weights_dir")
            bad.append(f"{key}={raw.get(str(err['loc'][0]))!r}: {err['msg'].removeprefix('Value error, ')}")
        raise MilesError("miles serve settings: " + "; ".join(bad)) from None
    missing = [d for d in out.get("weights_dirs") or [] if not os.path.isdir(d)]
    if missing:
        raise MilesError(f"weights_dir={raw['weights_dirs']!r}: {missing[0]} is not a folder; give the "
                         f"folder(s) weight updates are written to")
    return out


def check_samples(samples: int, limit: int) -> None:
    if samples > limit:
        raise ValueError(f"{samples} samples (prompts x n) in one request; at most {limit} (the "
                         f"server's max_samples_per_request): split it into several requests")


class PromptTooLarge(ValueError):
    """A request's text is over ``max_prompt_chars`` (answered 413)."""


def check_text_size(texts: Sequence[str], limit: int, what: str = "prompt") -> None:
    size = sum(len(t) for t in texts)
    if size > limit:
        raise PromptTooLarge(f"{what}: {size} characters of text to tokenize; at most {limit} (the "
                             f"server's max_prompt_chars); shorten it or send token ids")


def check_prompts(prompts: Sequence[Sequence[int]], params: Sequence[tuple[SamplingParams, int]],
                  vocab: int, context: int, explicit: Sequence[bool] | None = None,
                  max_samples: int = MAX_SAMPLES_PER_REQUEST) -> list[tuple[SamplingParams, int]]:
    """ValueError (a 400) naming the limit a request breaks; else ``params`` with a defaulted
    (not ``explicit``) ``max_new_tokens`` cut to what the model's context leaves, as a prompt
    near the context still gets an answer when the client did not ask for a length."""
    if not prompts:
        raise ValueError("no prompt given")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: the text encodes to no tokens (give at least one token)")
    check_token_ids([t for p in prompts for t in p], vocab, "input_ids")
    for sp, _ in params:
        check_token_ids(sp.stop_token_ids, vocab, "stop_token_ids")
    check_samples(sum(n for _, n in params), max_samples)
    out = list(params)
    if context:
        for i, (p, (sp, n)) in enumerate(zip(prompts, params)):
            if len(p) < context and not (explicit and explicit[i]):
                sp = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, context - len(p)))
                out[i] = (sp, n)
            if len(p) + sp.max_new_tokens > context:
                raise ValueError(f"prompt of {len(p)} tokens + max_new_tokens {sp.max_new_tokens} exceeds "
                                 f"the model's max_position_embeddings ({context}); shorten the prompt "
                                 f"or lower max_new_tokens")
    return out


def check_token_ids(ids: Sequence[int], vocab: int, field: str) -> None:
    """Every id in ``[0, vocab)`` (any non-negative int64 when the vocabulary size is unknown)."""
    top = vocab or 2**63
    bad = next((t for t in ids if not 0 <= t < top), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {top})")


def check_disk_path(model_path: Any, roots: list[str] | None) -> None:
    """``/update_weights_from_disk`` reads only under ``roots`` (None: anywhere)."""
    if not isinstance(model_path, str) or not model_path:
        raise ValueError("model_path: give the folder of the weight update as a string")
    if roots is None:
        return
    real = os.path.realpath(model_path)
    if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
        allowed = ", ".join(roots) or "none (this server was started without weights_dir=FOLDER)"
        raise ValueError(f"model_path {model_path!r} is outside the folders this server may read "
                         f"weights from: {allowed}")


class ServerBusy(Exception):
    """Too many large requests are being prepared already (answered 503 with Retry-After)."""


class Prep:
    """Runs request preparation (parsing, tokenization, chat templates) for large bodies on a few
    threads of its own, so the event loop keeps answering /health and small requests meanwhile;
    a body under ``INLINE_BODY_BYTES`` is prepared at once on the loop (cheaper than a thread
    hop). At most ``max_queued_mb`` of bodies wait or run here (a request over that gets a 503):
    their texts and tokens are what a burst of large requests would otherwise pile up in memory."""

    def __init__(self, workers: int = 2, max_queued_mb: float = 256.0):
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="miles-prep")
        self.max_queued, self.queued = int(max_queued_mb * 2**20), 0

    async def run(self, size: int, fn: Callable[[], T], offload: bool = False) -> T:
        """``fn()``, on a thread when ``size`` (the body's bytes) is large or ``offload``."""
        if size <= INLINE_BODY_BYTES and not offload:
            return fn()
        size = min(size, self.max_queued)  # one body of any size is taken when nothing waits
        if self.queued + size > self.max_queued:
            raise ServerBusy(f"{self.queued // 2**20} MB of large requests are being prepared; retry shortly")
        self.queued += size
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn)
        finally:
            self.queued -= size

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
