"""Request bodies of ``miles serve``'s ``/generate``, and its responses: the subset of SGLang's
``GenerateReqInput`` (``python/sglang/srt/managers/io_struct.py``) and ``SamplingParams``
(``python/sglang/srt/sampling/sampling_params.py``) the torch engine implements. Unknown fields and
supported-in-SGLang-but-not-here values are rejected with a message naming them, rather than
silently sampling something else than asked.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any

from miles import SamplingParams
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .routing import encode_routed, routed_of
from .spec_meta import spec_meta_info

if TYPE_CHECKING:
    from .scheduler import Request


class SamplingBody(BaseModel):
    """SGLang ``sampling_params`` (defaults as SGLang's)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    min_p: float = 0.0
    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**63 - 1)]] | None = None  # vocabulary: limits.py
    n: int = Field(1, ge=1)
    sampling_seed: int | None = Field(None, ge=0, le=2**63 - 1)  # a torch.Generator seed
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # only change how text is rendered; token ids and log-probs are unaffected
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False

    @model_validator(mode="after")
    def _supported(self):
        unsupported = {"min_p": (self.min_p, 0.0), "min_new_tokens": (self.min_new_tokens, 0),
                       "ignore_eos": (self.ignore_eos, False),
                       "frequency_penalty": (self.frequency_penalty, 0.0),
                       "presence_penalty": (self.presence_penalty, 0.0),
                       "repetition_penalty": (self.repetition_penalty, 1.0)}
        bad = [f"{k}={v!r}" for k, (v, default) in unsupported.items() if v != default]
        if self.stop:
            bad.append("stop (strings; use stop_token_ids)")
        if bad:
            raise ValueError(f"not supported by the torch engine: {', '.join(bad)}")
        return self

    def to_params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_new_tokens=self.max_new_tokens,
                              stop_token_ids=list(self.stop_token_ids or []), seed=self.sampling_seed)


class GenerateBody(BaseModel):
    """SGLang ``GenerateReqInput``: one prompt or a batch, as ``input_ids`` (or ``text``)."""

    model_config = ConfigDict(extra="forbid")

    rid: str | None = None
    input_ids: Any = None  # list[int] | list[list[int]], checked below (clearer errors than a union)
    text: str | list[str] | None = None
    sampling_params: Any = None  # SamplingBody | list[SamplingBody] | None, checked below
    return_logprob: bool | list[bool] | None = False
    return_text_in_logprobs: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    stream: bool = False
    return_routed_experts: bool = False
    lora_path: str | None = None
    log_metrics: bool = True

    @field_validator("input_ids")
    @classmethod
    def _ids(cls, v):
        if v is None:
            return v
        rows = v if isinstance(v, list) and v and all(isinstance(r, list) for r in v) else [v]
        for row in rows:
            if not isinstance(row, list) or not row:
                raise ValueError("must be a non-empty list of token ids or a list of such lists")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise ValueError("token ids must be integers")
        return v

    @field_validator("sampling_params")
    @classmethod
    def _sampling(cls, v):
        if v is None:
            return v
        try:
            if isinstance(v, list):
                return [SamplingBody.model_validate(s) for s in v]
            return SamplingBody.model_validate(v)
        except ValidationError as e:
            raise ValueError(errors_text(e)) from None

    @model_validator(mode="after")
    def _supported(self):
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of input_ids (token ids) or text")
        bad = [name for name, ok in (
            ("stream=true", not self.stream), ("lora_path", self.lora_path is None),
            ("logprob_start_len (prompt log-probs)", self.logprob_start_len in (None, -1)),
            ("top_logprobs_num", not self.top_logprobs_num)) if not ok]
        if bad:
            raise ValueError(f"not supported by miles serve: {', '.join(bad)}")
        if isinstance(self.sampling_params, list) and len({s.n for s in self.sampling_params}) > 1:
            raise ValueError("sampling_params: n must be the same for every prompt of a batch")
        return self

    @property
    def single(self) -> bool:
        """One prompt given flat (SGLang then answers with one object when n == 1)."""
        if self.text is not None:
            return isinstance(self.text, str)
        return not isinstance(self.input_ids[0], list)

    @property
    def wants_logprobs(self) -> bool:
        r = self.return_logprob
        return any(r) if isinstance(r, list) else bool(r)

    def prompts(self, tokenizer: Any) -> list[list[int]]:
        if self.text is not None:
            texts = [self.text] if isinstance(self.text, str) else self.text
            try:
                return [list(tokenizer.encode(t)) for t in texts]
            except Exception as e:  # noqa: BLE001 - characters the tokenizer cannot encode
                raise ValueError(f"text: the tokenizer cannot encode it ({type(e).__name__}: "
                                 f"{str(e)[:200]})") from None
        return [list(self.input_ids)] if self.single else [list(p) for p in self.input_ids]

    def sampling(self, batch: int) -> list[tuple[SamplingParams, int]]:
        """(params, n) per prompt."""
        sp = self.sampling_params
        if isinstance(sp, list):
            if len(sp) != batch:
                raise ValueError(f"sampling_params: {len(sp)} entries for {batch} prompts")
            return [(s.to_params(), s.n) for s in sp]
        sp = sp or SamplingBody()
        return [(sp.to_params(), sp.n)] * batch

    def explicit_lengths(self, batch: int) -> list[bool]:
        """Per prompt: whether the client set ``max_new_tokens`` (else SGLang's default 128)."""
        sp = self.sampling_params
        rows = sp if isinstance(sp, list) else [sp] * batch
        return [s is not None and "max_new_tokens" in s.model_fields_set for s in rows]

    def request_id(self) -> str:
        return self.rid or uuid.uuid4().hex


def errors_text(err: ValidationError) -> str:
    """Pydantic errors as ``field.path: message`` lines (the field the client must fix)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if loc and re.match(r"^\w+: ", msg):  # a nested model's own "field: message"
            lines.append(f"{loc}.{msg}")
        else:
            lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(lines)


def _finish_reason(reason: str, tokens: list[int], abort_message: str | None) -> dict:
    """SGLang's ``meta_info.finish_reason`` (``FINISH_MATCHED_TOKEN`` / ``FINISH_LENGTH`` /
    ``FINISH_ABORT`` as JSON, ``managers/schedule_batch.py``)."""
    if abort_message is not None or reason == "abort":
        return {"type": "abort", "message": abort_message or "aborted"}
    if reason == "stop":
        return {"type": "stop", "matched": tokens[-1] if tokens else None}
    return {"type": "length", "length": len(tokens)}


def format_outputs(req: Request, body: GenerateBody, tokenizer: Any, started: float,
                   version: int) -> list[dict]:
    """SGLang's ``/generate`` response items, ordered as SGLang orders parallel samples: all
    prompts' first samples, then all second samples (``GenerateReqInput._expand_inputs``). Every
    item carries a weight version, as SGLang's do: a request aborted before it ran reports
    ``version``, the engine's now (a missing one reads as a server restarted from its model
    folder to the sglang client, which would then push the same weights again)."""
    from miles_tokens import decode_batch

    n = req.items[0].n
    rows = [(item, j) for j in range(n) for item in req.items]
    comps = [None if req.aborted else item.completions[j] for item, j in rows]
    texts = decode_batch(tokenizer, [c.token_ids if c else [] for c in comps])
    logprobs = body.wants_logprobs
    token_texts = (iter(decode_batch(tokenizer, [[t] for c in comps if c for t in c.token_ids]))
                   if body.return_text_in_logprobs and logprobs else None)
    latency = time.monotonic() - started
    out = []
    for k, ((item, _), comp, text) in enumerate(zip(rows, comps, texts)):
        tokens = comp.token_ids if comp else []
        meta = {"id": req.rid if len(rows) == 1 else f"{req.rid}_{k}",
                "finish_reason": _finish_reason(comp.finish_reason if comp else "abort", tokens,
                                                req.aborted),
                "prompt_tokens": len(item.prompt), "completion_tokens": len(tokens),
                "weight_version": comp.weight_version if comp else version, "e2e_latency": latency}
        if logprobs:
            meta["output_token_logprobs"] = [
                [lp, t, next(token_texts) if token_texts else None]
                for lp, t in zip(comp.logprobs if comp else [], tokens)]
        if body.return_routed_experts and comp is not None and routed_of(comp) is not None:
            meta.update(encode_routed(routed_of(comp)))
        if comp is not None:  # a drafted completion's verify steps and drafts, as SGLang reports them
            meta.update(spec_meta_info(comp.extras))
        out.append({"text": text, "output_ids": list(tokens), "meta_info": meta})
    return out
