"""Speculative decoding's acceptance, from the ``/generate`` outputs the client received.

With speculative decoding on, SGLang answers every finished output with ``meta_info.spec_verify_ct``
(the verify steps of that request) and, in recent releases, ``spec_accept_token_num`` and
``spec_draft_token_num`` (drafts accepted and proposed; ``TokenizerManager.
_calculate_spec_decoding_metrics`` in ``python/sglang/srt/managers/tokenizer_manager.py``);
``miles serve`` answers the same fields. Over the drafted outputs (``spec_verify_ct > 0``) since the
last reading, the two figures the in-process torch engine reports (``rejection.acceptance``):
``spec_accept_len`` = tokens the verify steps emitted / verify steps, where an output's first token
comes from its prefill, not from a verify step, so it is left out (SGLang's per-request
``spec_accept_length`` divides all ``completion_tokens``, which for the short responses of a small
run reads up to a whole token higher); ``spec_accept_rate`` = drafts accepted / drafts proposed,
where the outputs give both counts.
"""
from __future__ import annotations

import threading
from typing import Any


class Acceptance:
    """Totals of the drafted outputs seen since the last ``drain`` (added from the client's event
    loop, drained from the loop's caller)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = self._zero()

    @staticmethod
    def _zero() -> dict[str, int]:
        return {"tokens": 0, "verify_ct": 0, "accepted": 0, "drafted": 0}

    def add(self, out: Any) -> None:
        """One ``/generate`` output; one without ``spec_verify_ct`` (no drafts) adds nothing."""
        meta = out.get("meta_info") if isinstance(out, dict) else None
        verify = (meta or {}).get("spec_verify_ct")
        if not isinstance(verify, int) or verify <= 0:
            return
        tokens = meta.get("completion_tokens")
        if not isinstance(tokens, int):
            tokens = len(meta.get("output_token_logprobs") or out.get("output_ids") or [])
        accepted, drafted = meta.get("spec_accept_token_num"), meta.get("spec_draft_token_num")
        with self._lock:
            t = self._totals
            t["tokens"] += max(tokens - 1, 0)  # the first token is the prefill's
            t["verify_ct"] += verify
            if isinstance(accepted, int) and isinstance(drafted, int) and drafted > 0:
                t["accepted"] += accepted
                t["drafted"] += drafted

    def drain(self) -> dict[str, float]:
        """``spec_accept_len`` and ``spec_accept_rate`` since the last call (empty: no drafted output)."""
        with self._lock:
            t, self._totals = self._totals, self._zero()
        if not t["verify_ct"]:
            return {}
        out = {"spec_accept_len": t["tokens"] / t["verify_ct"]}
        if t["drafted"]:
            out["spec_accept_rate"] = t["accepted"] / t["drafted"]
        return out
