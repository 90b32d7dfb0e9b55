"""The qwen3-next plugin on what the shared architecture tests' tiny configs leave out: Qwen3-Next
without the top-k renormalisation (``norm_topk_prob: false``, its router's switch, which Qwen3.5's
router lacks) in the engine, routing replay and megatron, and the configs it refuses."""
import pytest
from miles import make_plugin_manager
from miles.testing import (assert_lazy_registration, engine_matches_transformers, megatron_matches_transformers,
                           routing_replay_matches)
from miles_tinypolicy.frontier import frontier_config

UNNORMALISED = dict(frontier_config("qwen3_next"), norm_topk_prob=False)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe_text"])
def test_registers_without_torch(name):
    assert_lazy_registration("miles_plugin_qwen3_next", "architectures", name)


def test_configs_it_cannot_build_are_named():
    arch = make_plugin_manager().architecture("qwen3_next")
    base = frontier_config("qwen3_next")
    assert arch.check_config(base) == []
    assert arch.check_config({**base, "layer_types": ["linear_attention"]}) == [
        "model.config.layer_types has 1 entries; num_hidden_layers is 2"]
    (problem,) = arch.check_config({**base, "linear_num_value_heads": 3})
    assert problem.startswith("model.config.linear_num_value_heads (3) must be a multiple")


def test_unnormalised_top_k_in_the_engine_and_megatron():
    assert engine_matches_transformers(UNNORMALISED) <= 1e-5
    assert megatron_matches_transformers(UNNORMALISED) <= 1e-5


def test_unnormalised_top_k_under_routing_replay():
    same, changed = routing_replay_matches(UNNORMALISED)
    assert same <= 1e-5 < 1e-3 < changed
