"""The qwen2_moe architecture plugin against transformers, through miles.testing's parity checks.
The plugin is loaded from this folder by path (as ``miles train --plugin`` loads one), so the
tests run before it is installed."""
from pathlib import Path

import pytest
from miles import make_plugin_manager
from miles.testing import (assert_lazy_registration, engine_matches_transformers, megatron_matches_transformers,
                           megatron_round_trip, routing_replay_matches)

PLUGIN = str(Path(__file__).with_name("miles_plugin_qwen2_moe.py"))
# tiny: 2 layers, top-2 of 8 experts with a gated shared expert; the first layer dense
CONFIG = dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              mlp_only_layers=[0], tie_word_embeddings=False)


def test_registers_without_torch():
    assert_lazy_registration(PLUGIN, "architectures", "qwen2_moe")


def test_a_config_it_cannot_build_is_named():
    arch = make_plugin_manager(extra=[PLUGIN]).architecture("qwen2_moe")
    assert arch.check_config(CONFIG) == []
    assert arch.check_config({**CONFIG, "num_experts_per_tok": 9})[0].startswith("model.config.num_experts_per_tok")


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_engine_logprobs_equal_transformers(norm_topk_prob):
    assert engine_matches_transformers({**CONFIG, "norm_topk_prob": norm_topk_prob}, plugins=[PLUGIN]) <= 1e-5


def test_routing_replay():
    same, changed = routing_replay_matches(CONFIG, plugins=[PLUGIN])
    assert same <= 1e-5 < 1e-3 < changed


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2)])
def test_megatron_round_trip(tp, ep):
    assert megatron_round_trip(CONFIG, plugins=[PLUGIN], tp=tp, ep=ep) > 0


def test_megatron_logprobs_equal_transformers():
    assert megatron_matches_transformers(CONFIG, plugins=[PLUGIN]) <= 1e-5
