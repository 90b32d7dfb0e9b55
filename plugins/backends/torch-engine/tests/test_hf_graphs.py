"""The model's own forward decoding over a static cache (``hf_graphs.py``), the path whose decode
step a CUDA GPU replays from a graph. On CPU the same static-cache step runs eagerly, so this checks
what the graph records: for every frontier family it must sample exactly what the growing cache
samples (left-padded prompts, several samples each, sliding windows and sparse-attention top-k
exceeded), and its steps must read nothing from the device but the engine's stop check."""
from __future__ import annotations

import pytest
from miles import SamplingParams, make_plugin_manager
from miles.testing import PROMPTS, char_tokenizer, lively_weights, model_spec
from miles.testing.syncs import syncs_per_step
from miles_tinypolicy.frontier import FAMILIES, frontier_config

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine
from miles_plugin_torch_engine.hf_graphs import MIN_STEPS, static_cache, static_layers

STATIC = [f for f in FAMILIES if f != "deepseek_v4"]
EQUAL = [[2, 5, 6, 7, 8, 9], [2, 9, 8, 7, 6, 5]]
CHECK_EVERY = 4


@pytest.fixture(scope="module")
def pm():
    return make_plugin_manager()


def _engine(pm, config, replay: bool = False) -> TorchEngine:
    engine = TorchEngine(TorchEngineConfig(impl="hf"), spec=model_spec(config, pm=pm, replay=replay),
                         tokenizer=char_tokenizer(), seed=0)
    engine.load_weights(lively_weights(engine.model), version=1)
    engine.eos_id = None
    engine._fast = None  # the per-call path (hf_slots.py's continuous batcher is checked elsewhere)
    return engine


def _configs():
    # GLM-5 with an indexer top-k of 3: every decode step keeps fewer keys than the cache holds, so
    # the static cache's not yet written positions must never win the top-k
    dsa = dict(frontier_config("glm_moe_dsa"), index_topk=3)
    return [pytest.param(frontier_config(f), id=f) for f in STATIC] + [pytest.param(dsa, id="glm_moe_dsa-topk3")]


@pytest.mark.parametrize("config", _configs())
def test_static_cache_samples_what_the_growing_cache_samples(config, pm, single_thread):
    engine = _engine(pm, config)
    assert static_layers(engine.model)
    assert not engine._static, "CPU decodes over the growing cache unless told otherwise"
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    for prompts in (EQUAL, [list(p) for p in PROMPTS]):  # no mask at all, then left padding
        engine._static = False
        growing = engine.generate(prompts, params, n=2)
        engine._static = True
        static = engine.generate(prompts, params, n=2)
        for gs, ss in zip(growing, static):
            for g, s in zip(gs, ss):
                assert g.token_ids == s.token_ids
                assert max(abs(a - b) for a, b in zip(g.logprobs, s.logprobs)) < 1e-5
    # the static step reads nothing from the device: only the engine's stop check, every few steps
    engine.check_every = CHECK_EVERY

    def run(tokens: int) -> None:
        engine.generate([list(p) for p in PROMPTS], SamplingParams(temperature=1.0, max_new_tokens=tokens), n=2)

    count, extra = syncs_per_step(run, MIN_STEPS + 1, MIN_STEPS + 1 + 2 * CHECK_EVERY)
    assert count <= 1 / CHECK_EVERY, f"{config['model_type']}: {count} syncs per static decode step: {extra.by_site()}"


def test_sliding_layers_keep_every_position(pm):
    """gpt-oss's sliding layers get full-length static layers (the window is the mask's), so no
    layer's fill level lives on the host, where a replayed graph would not update it."""
    from transformers.cache_utils import StaticLayer

    engine = _engine(pm, frontier_config("gpt_oss"))
    cache = static_cache(engine.model, 40)
    assert len(cache.layers) == engine.model.config.num_hidden_layers
    assert all(type(layer) is StaticLayer for layer in cache.layers)


def test_which_engines_decode_over_a_static_cache(pm):
    """DeepSeek-V4's compressed attention has no static cache layer in transformers: it keeps the
    growing cache on any device. On CPU every family does (a static cache gains nothing there)."""
    v4 = _engine(pm, frontier_config("deepseek_v4"))
    assert not static_layers(v4.model)
    qwen = _engine(pm, frontier_config("qwen3_next"))
    assert static_layers(qwen.model) and not qwen._static


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_next"])
def test_routing_records_of_the_static_path(family, pm, single_thread):
    """R3 over the static cache records what the growing cache records, row for row."""
    engine = _engine(pm, frontier_config(family), replay=True)
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_new_tokens=MIN_STEPS + 3, seed=5)
    growing = engine.generate(prompts, params, n=2)
    engine._static = True
    static = engine.generate(prompts, params, n=2)
    key = engine._routing.recorder.extension
    for gs, ss in zip(growing, static):
        for g, s in zip(gs, ss):
            assert g.token_ids == s.token_ids
            assert g.extras[key]["routed_experts"].equal(s.extras[key]["routed_experts"])


def test_a_graph_capture_s_routing_entries_are_split_off_and_copied_per_replay(pm):
    """What the engine does around a capture (``GraphStep``), on CPU tensors: the entries logged
    during the capture leave the log, and each replay logs a copy of them (the graph overwrites its
    buffers at the next replay)."""
    import torch
    from miles.protocols import RecordsGraphReplays

    engine = _engine(pm, frontier_config("glm4_moe"), replay=True)
    rec = engine._routing.recorder
    assert isinstance(rec, RecordsGraphReplays)
    ids = torch.tensor([[2, 5, 6, 7]])
    with rec.recording(), torch.no_grad():
        engine.model(input_ids=ids)
        mark = rec.mark()
        engine.model(input_ids=ids)  # stands in for the capture
        captured = rec.split_off(mark)
        assert rec.mark() == mark and len(captured) == mark  # one entry per MoE layer
        for fill in (1, 2):  # two replays, each overwriting the buffers
            for t in captured:
                t.fill_(fill)
            rec.log_copies(captured)
    forwards = rec.take()
    assert len(forwards) == 3
    assert forwards[1].eq(1).all() and forwards[2].eq(2).all()


def _host_state(cache) -> list:
    """What a replayed graph cannot follow: each cache layer's host values (ints, bools, None) and
    the addresses of its tensors, nested lists and dicts included."""
    import torch

    def walk(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", value.data_ptr(), tuple(value.shape))
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    return [{k: walk(v) for k, v in vars(layer).items()} for layer in cache.layers]


@pytest.mark.parametrize("family", STATIC)
def test_decode_steps_change_no_host_state_of_the_cache(family, pm, single_thread):
    """A graph replays the step it captured: the same control flow, the same tensor addresses. So
    from the first decode step on, no step may change a cache layer's host values (a fill level
    kept as a Python int, a flag) or re-allocate one of its tensors."""
    import torch

    engine = _engine(pm, frontier_config(family))
    ids = torch.tensor([[0, 0, 2, 5, 6, 7], [2, 9, 8, 7, 6, 5]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    full = torch.ones(2, 6 + 8, dtype=torch.long)
    full[:, :6] = mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = static_cache(engine.model, 6 + 8)
    with torch.no_grad():
        out = engine._forward(ids, mask, pos, cache)
        tok, last = out.logits[:, -1].argmax(-1, keepdim=True), pos[:, -1:]
        states = []
        for _ in range(4):
            last = last + 1
            tok = engine._forward(tok, full, last, cache).logits[:, -1].argmax(-1, keepdim=True)
            states.append(_host_state(cache))
    assert all(s == states[0] for s in states[1:]), f"{family}: a decode step changed the cache's host state"
