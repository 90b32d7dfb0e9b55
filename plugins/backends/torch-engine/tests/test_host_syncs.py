"""Host syncs per decode step of the engine's generic path (``impl: hf``) for every frontier family,
counted on CPU (``miles.testing.syncs``): on a GPU each one stalls the launch queue, so a decode
loop that reads device data every step (or every layer) runs far behind ``generate``.

Each family runs with routing replay on (the ``moe`` spec records every router's experts), so the
routing log is in the loop too. Per decode step the engine may read whether every row stopped once
per ``check_every`` steps, and transformers' mask builder reads whether a left-padded mask is all
ones once per forward (``masking_utils._ignore_causal_mask_sdpa``; ``generate`` does the same with
padding, and without padding it still reads its stopping criteria every step: 1 per step).
"""
from __future__ import annotations

import pytest
from miles import SamplingParams, make_plugin_manager
from miles.testing import char_tokenizer, lively_weights, model_spec
from miles.testing.syncs import syncs_per_step
from miles_tinypolicy.frontier import FAMILIES, frontier_config

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine

CHECK_EVERY = 4  # as on CUDA (16 there): the stop flags are read every few steps, not every step
SHORT, LONG = CHECK_EVERY + 1, 2 * CHECK_EVERY + 1  # one stop check between them
PADDED = [[2, 5, 6, 7, 8, 9, 10, 11, 12, 13], [2, 11], [2, 12, 13, 14, 15]]
EQUAL = [[2, 5, 6, 7, 8, 9, 10, 11, 12, 13], [2, 13, 12, 11, 10, 9, 8, 7, 6, 5]]
# per decode step: the engine's stop check, plus (left-padded rows only) transformers' mask read
STOP_CHECK = 1 / CHECK_EVERY
BOUND = {"equal": STOP_CHECK, "padded": 1 + STOP_CHECK}


@pytest.fixture(scope="module")
def pm():
    return make_plugin_manager()


def per_step(engine: TorchEngine, prompts: list[list[int]]):
    def run(tokens: int) -> None:
        outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=tokens), n=2)
        assert all(len(c.token_ids) == tokens for cs in outs for c in cs)

    return syncs_per_step(run, SHORT, LONG)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_do_not_wait_for_the_device(family, pm, single_thread):
    spec = model_spec(frontier_config(family), pm=pm, replay=True)
    engine = TorchEngine(TorchEngineConfig(impl="hf"), spec=spec, tokenizer=char_tokenizer(), seed=0)
    engine.load_weights(lively_weights(engine.model), version=1)
    engine.eos_id, engine.check_every = None, CHECK_EVERY
    if engine._fast is not None:  # the continuous batcher (hf_slots.py) reads its stop flags as often
        engine._fast.sync_every = CHECK_EVERY
    cases = {"equal": EQUAL} if engine._equal_lengths else {"equal": EQUAL, "padded": PADDED}
    for case, prompts in cases.items():
        count, extra = per_step(engine, prompts)
        assert count <= BOUND[case], f"{family} ({case} prompts): {count} syncs per decode step: {extra.by_site()}"
        ours = extra.where("miles_plugin_", "/kernel/") / (LONG - SHORT)
        assert ours <= STOP_CHECK, f"{family} ({case}): miles code syncs {ours} per step: {extra.by_site()}"
