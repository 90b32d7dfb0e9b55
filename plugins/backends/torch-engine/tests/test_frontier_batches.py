"""Several prompts per forward on the model's own forward for the frontier architectures, under the
engine's continuous batcher: DeepSeek-V4 compresses keys by absolute position and ignores left
padding, so its prompts share prefills right-padded from position 0 (its cache rows,
``miles_plugin_deepseek.v4_slots``, load each prompt's own length) and its decode steps take rows of
any length; GLM-5's sparse-attention indexer masks padding, so its prompts share left-padded
prefills like any other model's. Each tiny random model is checked against transformers' own
forward of the same tokens, one sequence at a time."""
from __future__ import annotations

import pytest
import torch
from miles.testing.arch import lively_weights, reference_logprobs
from miles import SamplingParams, make_plugin_manager
from miles.testing import char_tokenizer

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
              tie_word_embeddings=False)
CONFIGS = {
    # compressed sparse attention every 4 tokens, heavily compressed every 8: both compressors emit
    # entries within these prompts, and the 8-token sliding window drops keys
    "deepseek_v4": dict(moe_intermediate_size=32, num_key_value_heads=1, head_dim=32, q_lora_rank=24,
                        num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, qk_rope_head_dim=8,
                        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe", "moe"], sliding_window=8, o_groups=2, o_lora_rank=16,
                        index_n_heads=8, index_head_dim=16, index_topk=4, hc_mult=2,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}),
    # index_topk 3: most queries choose among more keys than they may keep
    "glm_moe_dsa": dict(intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        head_dim=8, index_topk=3, index_head_dim=16, index_n_heads=8,
                        mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention"] * 2,
                        indexer_types=["full", "shared"]),
}
LENGTHS = [9, 13, 9, 6, 9, 13]  # three of one length, two of another, one alone
PROMPTS = [[2] + [3 + (7 * i + 5 * k) % 43 for k in range(n - 1)] for i, n in enumerate(LENGTHS)]
MAX_BATCH, N = 4, 2  # two prompts of two samples a chunk


@pytest.fixture(scope="module")
def engines():
    """Per model type, an engine built on first use, with the shapes of its model's forwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls gain nothing from threads on a shared CPU
    built: dict[str, tuple[TorchEngine, list[tuple[int, int]]]] = {}

    def get(model_type: str):
        if model_type not in built:
            pm = make_plugin_manager()
            settings = pm.registry("model_specs")["hf"].config(
                config={"model_type": model_type, **COMMON, **CONFIGS[model_type]})
            spec = pm.create("model_specs", "hf", settings, pm=pm)
            engine = TorchEngine(TorchEngineConfig(impl="hf", max_batch_size=MAX_BATCH), spec=spec,
                                 tokenizer=char_tokenizer(), seed=0)
            engine.load_weights(lively_weights(engine.model), version=1)
            shapes: list[tuple[int, int]] = []
            engine.model.register_forward_pre_hook(
                lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
            built[model_type] = engine, shapes
        return built[model_type]
    yield get
    torch.set_num_threads(before)


def expected_prefills() -> list[tuple[int, int]]:
    """(rows, width) of each prefill: two prompts join at a time (their 4 rows fill the cache),
    padded to the longer (DeepSeek-V4 on the right, GLM-5 on the left)."""
    per = MAX_BATCH // N
    return [(len(LENGTHS[s:s + per]), max(LENGTHS[s:s + per])) for s in range(0, len(LENGTHS), per)]


@pytest.mark.parametrize("model_type", CONFIGS)
def test_sampled_logprobs_equal_a_transformers_forward_and_prompts_share_forwards(model_type, engines):
    engine, shapes = engines(model_type)
    shapes.clear()
    outs = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=12), n=N)
    calls = list(shapes)  # before the reference forwards below add theirs
    worst = 0.0
    for prompt, comps in zip(PROMPTS, outs):
        assert len(comps) == N
        for comp in comps:
            assert comp.token_ids and len(comp.logprobs) == len(comp.token_ids)
            want = reference_logprobs(engine.model, prompt, comp.token_ids)
            worst = max(worst, (want - torch.tensor(comp.logprobs)).abs().max().item())
    assert worst < 1e-5, f"{model_type}: engine log-probs differ from transformers' forward by {worst:.2e}"
    prefills = [s for s in calls if s[1] > 1]
    assert prefills == expected_prefills()
    # decode steps take every live row, of whatever length (DeepSeek-V4's too)
    assert max(rows for rows, width in calls if width == 1) == MAX_BATCH


@pytest.mark.parametrize("model_type", CONFIGS)
def test_greedy_outputs_equal_per_prompt_greedy_generation(model_type, engines):
    engine, _ = engines(model_type)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[])
    outs = engine.generate(PROMPTS, params, n=1)
    for prompt, (comp,) in zip(PROMPTS, outs):
        with torch.no_grad():
            ids = engine.model.generate(torch.tensor([prompt]), attention_mask=torch.ones_like(torch.tensor([prompt])),
                                        max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        want = ids[0, len(prompt):].tolist()
        assert comp.token_ids == want[:len(comp.token_ids)]


def test_scoring_right_pads_pairs_of_any_length_and_equals_a_transformers_forward(engines):
    """``logprobs``: prompts and responses of different lengths, each pair right-padded from
    position 0, ``max_batch_size`` pairs a forward."""
    engine, shapes = engines("deepseek_v4")
    responses = [[5 + (3 * i + k) % 40 for k in range(2 + i)] for i in range(len(PROMPTS))]
    shapes.clear()
    got = engine.logprobs(PROMPTS, responses)
    total = [len(p) + len(r) for p, r in zip(PROMPTS, responses)]
    chunks = [total[s:s + MAX_BATCH] for s in range(0, len(total), MAX_BATCH)]
    assert shapes == [(len(c), max(c)) for c in chunks]
    for prompt, response, lp in zip(PROMPTS, responses, got):
        want = reference_logprobs(engine.model, prompt, response)
        assert (want - torch.tensor(lp)).abs().max().item() < 1e-5
