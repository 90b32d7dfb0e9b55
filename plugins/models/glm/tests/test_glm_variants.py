"""The glm plugin on what the shared architecture tests' tiny configs leave out: GLM-4.5 with q/k
norms, RoPE on half of each head, no dense first layer and routing over all experts as one group,
in the engine, routing replay and megatron; and the configs it refuses, each named."""
import pytest
from miles import make_plugin_manager
from miles.testing import (assert_lazy_registration, engine_matches_transformers, megatron_matches_transformers,
                           routing_replay_matches)
from miles_tinypolicy.frontier import frontier_config

VARIANT = dict(frontier_config("glm4_moe"), use_qk_norm=True, partial_rotary_factor=0.5,
               first_k_dense_replace=0, n_group=1, topk_group=1)


@pytest.mark.parametrize("name", ["glm4_moe", "glm_moe_dsa"])
def test_registers_without_torch(name):
    assert_lazy_registration("miles_plugin_glm", "architectures", name)


@pytest.mark.parametrize("over, problem", [
    ({"n_group": 3}, "model.config.n_routed_experts (8) must be a multiple of n_group (3)"),
    ({"topk_group": 3}, "model.config.topk_group (3) must be at most n_group (2)"),
    ({"num_experts_per_tok": 5}, "model.config.num_experts_per_tok (5) must be at most the experts of "
                                 "topk_group groups (4)"),
])
def test_routing_configs_it_cannot_build_are_named(over, problem):
    arch = make_plugin_manager().architecture("glm4_moe")
    assert arch.check_config(frontier_config("glm4_moe")) == []
    assert arch.check_config({**frontier_config("glm4_moe"), **over}) == [problem]


def test_glm5_per_layer_lists_must_cover_every_layer():
    base = frontier_config("glm_moe_dsa")
    arch = make_plugin_manager().architecture("glm_moe_dsa")
    assert arch.check_config(base) == []
    assert arch.check_config({**base, "indexer_types": ["full"]}) == [
        "model.config.indexer_types has 1 entries; num_hidden_layers is 2"]


def test_qk_norms_and_partial_rope_in_the_engine_and_megatron():
    assert engine_matches_transformers(VARIANT) <= 1e-5
    assert megatron_matches_transformers(VARIANT) <= 1e-5


def test_routing_replay_over_one_group():
    same, changed = routing_replay_matches(VARIANT)
    assert same <= 1e-5 < 1e-3 < changed
