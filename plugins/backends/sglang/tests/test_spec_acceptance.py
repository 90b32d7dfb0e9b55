"""``spec_accept_len`` / ``spec_accept_rate`` from ``/generate`` outputs as SGLang shapes them: the
drafted outputs count, the others (no drafts, stopped at the prefill's token) do not."""
from miles_plugin_sglang.speculative import Acceptance


def _out(tokens: int, **spec) -> dict:
    return {"output_ids": list(range(tokens)), "meta_info": {"completion_tokens": tokens, **spec}}


def test_drafted_outputs_give_tokens_per_verify_step_and_the_accepted_share():
    a = Acceptance()
    a.add(_out(9, spec_verify_ct=4, spec_accept_token_num=5, spec_draft_token_num=8))
    a.add(_out(4, spec_verify_ct=2, spec_accept_token_num=1, spec_draft_token_num=4))
    a.add(_out(7))  # decoded without drafts (a server call above its max_batch)
    a.add(_out(1, spec_verify_ct=0, spec_accept_token_num=0, spec_draft_token_num=0))  # stopped at once
    # the verify steps emitted 8 + 3 tokens (each output's first is the prefill's) in 6 steps
    assert a.drain() == {"spec_accept_len": 11 / 6, "spec_accept_rate": 6 / 12}
    assert a.drain() == {}


def test_outputs_with_only_the_verify_count_give_the_length_alone():
    a = Acceptance()  # a server that reports spec_verify_ct but not the draft counts
    a.add({"output_ids": [1, 2, 3, 4], "meta_info": {"spec_verify_ct": 2}})
    assert a.drain() == {"spec_accept_len": 1.5}
