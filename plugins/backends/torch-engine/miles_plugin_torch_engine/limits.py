"""Limits ``miles serve`` puts on what a client may ask: prompt lengths against the model's
context, the work one request may queue, the folders a disk weight update may read, and the
weights-update group join (run off the engine thread, with a deadline)."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import threading
import time
from typing import Any, Callable, Sequence

from miles import MilesError, SamplingParams

from .guard import DEFAULT_MAX_BODY_MB

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
MAX_SAMPLES_PER_REQUEST = 4096  # prompts x n of one /generate call (max_batch_size chunks it)
GROUP_JOIN_TIMEOUT_S = 600.0


def check_prompts(prompts: Sequence[Sequence[int]], params: Sequence[tuple[SamplingParams, int]],
                  vocab: int, context: int, explicit: Sequence[bool] | None = None
                  ) -> list[tuple[SamplingParams, int]]:
    """ValueError (a 400) naming the limit a request breaks; else ``params`` with a defaulted
    (not ``explicit``) ``max_new_tokens`` cut to what the model's context leaves, as a prompt
    near the context still gets an answer when the client did not ask for a length."""
    if not prompts:
        raise ValueError("no prompt given")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: the text encodes to no tokens (give at least one token)")
    bad = [t for p in prompts for t in p if not 0 <= t < vocab] if vocab else []
    if bad:
        raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    samples = sum(n for _, n in params)
    if samples > MAX_SAMPLES_PER_REQUEST:
        raise ValueError(f"{samples} samples (prompts x n) in one request; at most "
                         f"{MAX_SAMPLES_PER_REQUEST}: split it into several requests")
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


def server_settings(settings: dict, host: str) -> dict:
    """Take the server's own keys out of ``settings`` (the rest are engine settings):
    ``max_body_mb`` (request body limit) and ``weights_dir`` (the folders, separated by
    ``os.pathsep``, ``/update_weights_from_disk`` may read; unset: any folder; shards are
    safetensors in every case)."""
    out: dict[str, Any] = {}
    raw = settings.pop("max_body_mb", DEFAULT_MAX_BODY_MB)
    try:
        out["max_body_mb"] = float(raw)
    except (TypeError, ValueError):
        out["max_body_mb"] = -1.0
    if not 0 < out["max_body_mb"] <= 4096:
        raise MilesError(f"max_body_mb={raw!r}: give a size in MB in (0, 4096], e.g. max_body_mb=8")
    dirs = settings.pop("weights_dir", None)
    if dirs is None:
        out["weights_dirs"] = None
    else:
        roots = [d for d in (dirs if isinstance(dirs, list) else str(dirs).split(os.pathsep)) if d]
        missing = [d for d in roots if not os.path.isdir(d)]
        if missing or not roots:
            raise MilesError(f"weights_dir={dirs!r}: {missing[0] if missing else 'no folder'} is not a "
                             f"folder; give the folder(s) weight updates are written to")
        out["weights_dirs"] = [os.path.realpath(d) for d in roots]
    return out


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


class GroupJoins:
    """``/init_weights_update_group`` on its own thread with a deadline: joining waits for the
    other ranks (or for a store that never answers), which must not stall generation. ``state``
    is what ``/health`` reports."""

    def __init__(self, timeout_s: float = GROUP_JOIN_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.state: dict[str, Any] = {"state": "none"}

    async def join(self, fn: Callable[..., Any], kwargs: dict) -> Any:
        if "timeout_s" in inspect.signature(fn).parameters:
            kwargs = {"timeout_s": self.timeout_s, **kwargs}
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result, error = fn(**kwargs), None
            except BaseException as e:  # noqa: BLE001 - handed to the waiting handler
                result, error = None, e
            loop.call_soon_threadsafe(lambda: future.done() or (
                future.set_exception(error) if error else future.set_result(result)))

        self.state = {"state": "joining", "group_name": kwargs.get("group_name"), "since": time.time()}
        threading.Thread(target=run, name="miles-group-join", daemon=True).start()
        try:
            result = await asyncio.wait_for(asyncio.shield(future), self.timeout_s + 5.0)
        except asyncio.TimeoutError:
            self.state = {"state": "failed", "group_name": kwargs.get("group_name"),
                          "message": f"no answer from the group's peers within {self.timeout_s:.0f} s"}
            raise TimeoutError(self.state["message"]) from None
        except Exception as e:
            self.state = {"state": "failed", "group_name": kwargs.get("group_name"),
                          "message": f"{type(e).__name__}: {str(e)[:300]}"}
            raise
        self.state = {"state": "ready", "group_name": kwargs.get("group_name")}
        return result
