"""Continuous batching on the model's own forward (``hf_slots.py``) for every frontier family with
static cache layers: more samples than cache rows, so rows join while others decode and finished
rows move to fill holes; samples stop at different lengths. Every completion's log-probs must equal
a transformers forward of its tokens (float32, 1e-5) and its routing record (R3) the experts that
forward routes to."""
from __future__ import annotations

import pytest
import torch
from miles import SamplingParams, make_plugin_manager
from miles.testing import PROMPTS, char_tokenizer, lively_weights, model_spec
from miles.testing.arch import reference_logprobs
from miles_tinypolicy.frontier import FAMILIES, frontier_config

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine
from miles_plugin_torch_engine.hf_slots import SlotGenerator, slot_kinds

SLOTTED = list(FAMILIES)
ROWS = 5  # cache rows: 3 prompts x 2 samples do not fit at once


@pytest.fixture(scope="module")
def pm():
    return make_plugin_manager()


def _configs():
    # GLM-5 with an indexer top-k of 3: rows whose positions differ choose among different key counts
    dsa = dict(frontier_config("glm_moe_dsa"), index_topk=3)
    # DeepSeek-V4 with a sliding-window layer of its own (no compressor) after the compressed ones
    v4 = frontier_config("deepseek_v4")
    v4 = dict(v4, num_hidden_layers=3, layer_types=[*v4["layer_types"], "sliding_attention"],
              mlp_layer_types=[*v4["mlp_layer_types"], "moe"])
    return [pytest.param(frontier_config(f), id=f) for f in SLOTTED] + [
        pytest.param(dsa, id="glm_moe_dsa-topk3"), pytest.param(v4, id="deepseek_v4-sliding")]


def _reference(engine: TorchEngine, prompt: list[int], comp) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of the sampled tokens, routed experts of every fed position) from one cache-less
    forward of the prompt and response."""
    rec = engine._routing.recorder
    ids = torch.tensor([prompt + comp.token_ids])
    with rec.recording(), torch.inference_mode():
        logits = engine.model(input_ids=ids, use_cache=False).logits[0].float()
    (routed,) = rec.take()
    want = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, torch.tensor(comp.token_ids)[:, None])[:, 0]
    return want, routed[:len(prompt) + len(comp.token_ids) - 1]


@pytest.mark.parametrize("config", _configs())
def test_rows_join_and_leave_and_every_sample_equals_transformers(config, pm, single_thread):
    engine = TorchEngine(TorchEngineConfig(impl="hf", max_batch_size=ROWS),
                         spec=model_spec(config, pm=pm, replay=True), tokenizer=char_tokenizer(), seed=0)
    engine.load_weights(lively_weights(engine.model), version=1)
    assert isinstance(engine._fast, SlotGenerator)
    prompts = [list(p) for p in PROMPTS]
    # a common token stops some samples early, so rows leave at different steps
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3, stop_token_ids=[5, 7])
    outs = engine.generate(prompts, params, n=2)
    stats = engine._fast.stats
    assert stats["joined_mid_decode"] > 0 and stats["max_rows"] <= ROWS
    lengths = {len(c.token_ids) for cs in outs for c in cs}
    assert len(lengths) > 1, "every sample ran the same length: no row moved"
    worst, key = 0.0, engine._routing.recorder.extension
    mismatched = total = 0
    for prompt, comps in zip(prompts, outs):
        assert len(comps) == 2
        for c in comps:
            want, routed = _reference(engine, prompt, c)
            worst = max(worst, (want - torch.tensor(c.logprobs)).abs().max().item())
            got = c.extras[key]["routed_experts"]
            assert got.shape == routed.shape
            mismatched += int((got.sort(-1).values != routed.sort(-1).values.to(got.dtype)).any(-1).sum())
            total += routed.shape[0] * routed.shape[1]
    name = config["model_type"]
    assert worst < 1e-5, f"{name}: log-probs differ from transformers' forward by {worst:.2e}"
    # a decode step's router logits differ from the cache-less forward's by float32 rounding (a
    # recurrent step against a chunked scan, for instance), which can flip a rare near-tie
    assert mismatched <= max(1, total // 100), f"{name}: {mismatched} of {total} routed (token, layer) pairs differ"


def test_greedy_slots_equal_the_per_call_path(pm, single_thread):
    """The same greedy tokens as the per-call path (one prefill per call, lock-step decode)."""
    engine = TorchEngine(TorchEngineConfig(impl="hf", max_batch_size=3),
                         spec=model_spec(frontier_config("qwen3_next"), pm=pm), tokenizer=char_tokenizer(), seed=0)
    engine.load_weights(lively_weights(engine.model), version=1)
    engine.eos_id = None
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    slots = engine.generate(prompts, params)
    engine._fast = None
    per_call = engine.generate(prompts, params)
    assert [c.token_ids for cs in slots for c in cs] == [c.token_ids for cs in per_call for c in cs]


def test_deepseek_v4_slots_in_bfloat16(pm, single_thread):
    """DeepSeek-V4's slot rows in the GPU's dtype: the compressors' gates add the position bias in
    bfloat16, as transformers does, into float32 state. On CPU the engine decodes half precision
    per call, so the slot generator is built here directly."""
    from miles_plugin_torch_engine.hf_slots import slot_generator

    spec = model_spec(frontier_config("deepseek_v4"), pm=pm)
    engine = TorchEngine(TorchEngineConfig(impl="hf", dtype="bfloat16", max_batch_size=ROWS), spec=spec,
                         tokenizer=char_tokenizer(), seed=0)
    engine.load_weights(lively_weights(engine.model), version=1)
    engine.eos_id = None
    engine._fast = slot_generator(engine.cfg, engine.model, engine._cache_kw, None, spec.architecture())
    prompts = [list(p) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10, seed=3), n=2)
    assert engine._fast.stats["decode_steps"] > 0
    diff = torch.cat([(reference_logprobs(engine.model, p, c.token_ids) - torch.tensor(c.logprobs)).abs()
                      for p, cs in zip(prompts, outs) for c in cs])
    assert diff.mean() <= 1e-3 and diff.max() <= 0.05, (diff.mean(), diff.max())


def test_which_models_get_slots(pm):
    """Every layer kind of the frontier families: transformers' static layers, and DeepSeek-V4's
    compressed attention through its architecture's own slot layers (``OffersSlotLayers``); and
    only attention backends that take a 4-D mask."""
    from miles.protocols import OffersSlotLayers

    v4 = TorchEngine(TorchEngineConfig(impl="hf"), spec=model_spec(frontier_config("deepseek_v4"), pm=pm),
                     tokenizer=char_tokenizer(), seed=0)
    assert slot_kinds(v4.model) is None
    assert isinstance(v4._fast, SlotGenerator) and isinstance(v4._fast.fwd.arch, OffersSlotLayers)
    gpt = TorchEngine(TorchEngineConfig(impl="hf"), spec=model_spec(frontier_config("gpt_oss"), pm=pm),
                      tokenizer=char_tokenizer(), seed=0)
    assert set(slot_kinds(gpt.model)) == {"sliding_attention", "full_attention"}
    gpt.model.config._attn_implementation = "flash_attention_2"
    assert slot_kinds(gpt.model) is None


def test_a_graph_warm_up_leaves_linear_attention_states_as_they_were(pm, single_thread):
    """Before a capture the decode step runs once (the warm-up), and gated DeltaNet's states advance
    in place: ``saved_state`` puts them back, so the replay that follows is the step's only one."""
    engine = TorchEngine(TorchEngineConfig(impl="hf", max_batch_size=2),
                         spec=model_spec(frontier_config("qwen3_next"), pm=pm), tokenizer=char_tokenizer(), seed=0)
    engine.load_weights(lively_weights(engine.model), version=1)
    fwd = engine._fast.fwd
    fwd.allocate(2, 32)
    ids = torch.tensor([[2, 5, 6, 7, 0], [2, 9, 8, 7, 6]])
    fwd.prefill(ids, torch.tensor([4, 5]), torch.arange(2), torch.tensor([1, 1]))
    tok, pos = torch.tensor([11, 12]), torch.tensor([4, 5])
    restore = fwd.saved_state()
    first = fwd.decode(tok, pos, 8).clone()  # the warm-up
    assert not torch.equal(first, fwd.decode(tok, pos, 8)), "a second step from advanced states differs"
    restore()
    assert torch.equal(first, fwd.decode(tok, pos, 8))
    assert fwd.saved_state() is not None
