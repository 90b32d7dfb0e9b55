"""``engine_stats()`` (miles.protocols.EngineStats) of the torch engine on each of its paths: read
in the middle of a generate call and from another thread while it runs, and after it (the tokens
counted are exactly those returned, also when the call is interrupted)."""
import threading

import pytest
from miles import SamplingParams
from miles.protocols import EngineStats
from miles.testing import TinySpec, char_tokenizer

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = [[2, 5 + i, 6, 7][: 2 + i % 3] for i in range(6)]


def make(**cfg) -> TorchEngine:
    return TorchEngine(TorchEngineConfig.model_validate(cfg), spec=TinySpec(), tokenizer=char_tokenizer(), seed=0)


def check(reading: dict, rows: int) -> None:
    assert reading["name"].startswith("torch")
    assert 0 <= reading["running"] <= rows and 0 <= reading["queued"] <= rows
    assert reading["running"] + reading["queued"] <= rows
    assert 0.0 <= reading.get("kv_cache_usage", 0.0) <= 1.0


def watched(engine: TorchEngine, step_owner, n: int, params: SamplingParams, interrupt_at: int = 0):
    """Generate ``n`` samples of PROMPTS while readings are taken inside every decode step (on the
    generating thread) and from a reader thread; returns (completions, inside, outside)."""
    inside, outside, done = [], [], threading.Event()
    decode = step_owner._decode

    def spy(live, t):
        inside.append(engine.engine_stats()[0])
        if interrupt_at and len(inside) == interrupt_at:
            engine.interrupt.set()
        return decode(live, t)

    def reader():
        while not done.wait(0.002):
            outside.append(engine.engine_stats()[0])
    step_owner._decode = spy
    th = threading.Thread(target=reader)
    th.start()
    try:
        outs = engine.generate(PROMPTS, params, n=n)
    finally:
        done.set()
        th.join()
        del step_owner._decode
        engine.interrupt.clear()
    return outs, inside, outside


def tokens(outs) -> int:
    return sum(len(c.token_ids) for group in outs for c in group)


@pytest.mark.parametrize("speculative", [False, True])
def test_fast_path_readings_during_and_after_a_call(speculative):
    spec = {"speculative": {"draft": "head", "tokens": 2, "max_batch": 64}} if speculative else {}
    engine = make(max_batch_size=8, **spec)
    assert isinstance(engine, EngineStats)
    before = engine.engine_stats()[0]
    assert before["running"] == before["queued"] == 0 and before["generated_tokens"] == 0
    gen = engine._spec if speculative else engine._fast
    rows = len(PROMPTS) * 4
    outs, inside, outside = watched(engine, gen, 4, SamplingParams(1.0, 1.0, 0, 12, []))
    for r in inside + outside:
        check(r, rows)
    # 24 rows over 8 cache rows: some wait while others decode, and the cache fills with their positions
    assert max(r["running"] for r in inside) == 8 and max(r["queued"] for r in inside) > 0
    assert max(r["kv_cache_usage"] for r in inside) > 0
    counts = [r["generated_tokens"] for r in inside]
    assert counts == sorted(counts) and 0 < counts[-1] <= tokens(outs)
    after = engine.engine_stats()[0]
    assert after["generated_tokens"] == tokens(outs)  # exactly what the call returned
    assert after["running"] == after["queued"] == 0 and after["kv_cache_usage"] == 0.0
    assert ("spec_accept_rate" in after) == speculative
    if speculative:
        assert 0.0 <= after["spec_accept_rate"] <= 1.0
    again = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=5), n=2)
    assert engine.engine_stats()[0]["generated_tokens"] == tokens(outs) + tokens(again)


def test_an_interrupted_call_counts_the_tokens_it_returned():
    engine = make(max_batch_size=8)
    outs, inside, _ = watched(engine, engine._fast, 4, SamplingParams(1.0, 1.0, 0, 20, []), interrupt_at=5)
    assert any(c.finish_reason == "abort" for group in outs for c in group)
    after = engine.engine_stats()[0]
    assert after["generated_tokens"] == tokens(outs) and after["running"] == after["queued"] == 0


def test_the_models_own_forward_counts_chunks():
    engine = make(impl="hf", max_batch_size=8)
    engine._fast = None  # the per-call path (what runs with speculative decoding configured)
    seen = []
    chunk = engine._generate_chunk

    def spy(*args):
        seen.append(engine.engine_stats()[0])
        return chunk(*args)
    engine._generate_chunk = spy
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6), n=4)
    assert [(r["running"], r["queued"]) for r in seen] == [(8, 16), (8, 8), (8, 0)]  # 2 prompts x 4 a chunk
    assert "kv_cache_usage" not in seen[0]  # the model's own cache grows as it goes: no fixed size
    after = engine.engine_stats()[0]
    assert after["generated_tokens"] == tokens(outs) and after["running"] == after["queued"] == 0
