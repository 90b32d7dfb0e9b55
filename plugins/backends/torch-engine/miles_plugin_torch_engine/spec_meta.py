"""A drafted completion's own speculative counts, and how ``miles serve`` answers them.

The speculative generators (``speculative.py``, ``hf_speculative.py``) put each completion's
verify steps and drafts in ``Completion.extras[EXTRAS_KEY]``; ``/generate`` returns them in
``meta_info`` under SGLang's names (``TokenizerManager._calculate_spec_decoding_metrics`` in
``python/sglang/srt/managers/tokenizer_manager.py``), so a client computes the acceptance of the
completions it received as it would from SGLang: ``completion_tokens / spec_verify_ct`` tokens a
verify step, ``spec_accept_token_num / spec_draft_token_num`` of the drafts accepted. A completion
decoded without drafts (a call above ``engine.speculative.max_batch``) carries none.
"""
from __future__ import annotations

from typing import Any

EXTRAS_KEY = "speculative"


def spec_counts(verify_steps: int, accepted: int, k: int) -> dict[str, int]:
    """One drafted completion's verify steps, drafts accepted and drafts proposed (``k`` a step)."""
    return {"verify_ct": int(verify_steps), "accepted": int(accepted), "drafted": int(verify_steps) * k}


def spec_meta_info(extras: dict[str, Any]) -> dict[str, int]:
    """SGLang's ``meta_info`` fields of a completion's counts (empty: it was not drafted)."""
    c = extras.get(EXTRAS_KEY)
    if c is None:
        return {}
    return {"spec_verify_ct": c["verify_ct"], "spec_accept_token_num": c["accepted"],
            "spec_draft_token_num": c["drafted"]}
