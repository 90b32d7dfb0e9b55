"""The gpt-oss plugin on what the shared architecture tests' tiny config leaves out: full attention
in every layer (no sliding window) in the engine and megatron, and the configs the megatron
trainer refuses, each named."""
import pytest
from miles import MilesError, make_plugin_manager
from miles.testing import assert_lazy_registration, engine_matches_transformers, megatron_matches_transformers
from miles_tinypolicy.frontier import frontier_config
from transformers import GptOssConfig

BASE = frontier_config("gpt_oss")
FULL = dict(BASE, layer_types=["full_attention", "full_attention"])


def test_registers_without_torch():
    assert_lazy_registration("miles_plugin_gpt_oss", "architectures", "gpt_oss")


def test_configs_it_cannot_build_are_named():
    arch = make_plugin_manager().architecture("gpt_oss")
    assert arch.check_config(BASE) == []
    assert arch.check_config({**BASE, "layer_types": ["full_attention"]}) == [
        "model.config.layer_types has 1 entries; num_hidden_layers is 2"]
    assert arch.check_config({**BASE, "num_experts_per_tok": 9}) == [
        "model.config.num_experts_per_tok must be at most num_local_experts"]


@pytest.mark.parametrize("over, says", [
    ({"attention_bias": False}, "attention_bias: false is not supported"),
    ({"sliding_window": None}, "sliding_window is not set"),
])
def test_megatron_refuses_what_it_cannot_build(over, says):
    hf = GptOssConfig(**{k: v for k, v in BASE.items() if k != "model_type"})
    for key, value in over.items():
        setattr(hf, key, value)
    with pytest.raises(MilesError, match=says):
        make_plugin_manager().architecture("gpt_oss").megatron_arch(hf)


def test_full_attention_everywhere_in_the_engine_and_megatron():
    assert engine_matches_transformers(FULL) <= 1e-5
    assert megatron_matches_transformers(FULL) <= 1e-5
