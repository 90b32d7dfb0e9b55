"""The deepseek plugin on what the shared architecture tests' tiny configs leave out: DeepSeek-V3
without the query's low-rank projection (``q_lora_rank: null``), routing over all experts as one
group, with and without renormalising the chosen scores, in the engine (absorbed MLA decode),
routing replay and megatron; and the configs it refuses, each named."""
import pytest
from miles import MilesError, make_plugin_manager
from miles.testing import (assert_lazy_registration, engine_matches_transformers, megatron_matches_transformers,
                           routing_replay_matches)
from miles_tinypolicy.frontier import frontier_config
from transformers import DeepseekV3Config

BASE = frontier_config("deepseek_v3")
VARIANT = dict(BASE, q_lora_rank=None, n_group=1, topk_group=1)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v4"])
def test_registers_without_torch(name):
    assert_lazy_registration("miles_plugin_deepseek", "architectures", name)


@pytest.mark.parametrize("over, problem", [
    ({"n_group": 3}, "model.config.n_routed_experts (8) must be a multiple of n_group (3)"),
    ({"num_experts_per_tok": 5}, "model.config.num_experts_per_tok (5) must be at most the experts of "
                                 "topk_group groups (4)"),
    ({"qk_rope_head_dim": 7}, "model.config.qk_rope_head_dim must be even (rotary embeddings)"),
])
def test_configs_it_cannot_build_are_named(over, problem):
    arch = make_plugin_manager().architecture("deepseek_v3")
    assert arch.check_config(BASE) == []
    assert arch.check_config({**BASE, **over}) == [problem]


@pytest.mark.parametrize("over, says", [
    ({"rope_interleave": False}, "rope_interleave: false is not supported"),
    ({"norm_topk_prob": False}, "norm_topk_prob: false is not supported"),
])
def test_megatron_refuses_what_it_cannot_build(over, says):
    hf = DeepseekV3Config(**{k: v for k, v in {**VARIANT, **over}.items() if k != "model_type"})
    with pytest.raises(MilesError, match=says):
        make_plugin_manager().architecture("deepseek_v3").megatron_arch(hf)


@pytest.mark.parametrize("norm", [True, False])
def test_full_rank_queries_and_one_group_in_the_engine_and_under_replay(norm):
    config = dict(VARIANT, norm_topk_prob=norm)
    assert engine_matches_transformers(config) <= 1e-5
    same, changed = routing_replay_matches(config)
    assert same <= 1e-5 < 1e-3 < changed


def test_full_rank_queries_and_one_group_in_megatron():
    assert megatron_matches_transformers(dict(VARIANT, norm_topk_prob=True)) <= 1e-5
