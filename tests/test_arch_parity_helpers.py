"""miles.testing's architecture parity checks fail on a plugin that gets its architecture wrong:
the example plugin (examples/arch-plugin) with one rule broken at a time."""
from pathlib import Path

import pytest
from miles.testing import megatron_matches_transformers, megatron_round_trip, routing_replay_matches

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arch-plugin"
CONFIG = dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              mlp_only_layers=[0], tie_word_embeddings=False)


def broken(tmp_path: Path, old: str, new: str) -> str:
    """The example plugin's module with ``old`` replaced by ``new``, as a file to load."""
    src = (EXAMPLE / "miles_plugin_qwen2_moe.py").read_text()
    assert old in src, old
    path = tmp_path / "miles_plugin_qwen2_moe_broken.py"
    path.write_text(src.replace(old, new))
    return str(path)


def test_replay_with_gate_weights_unlike_the_router_is_caught(tmp_path):
    """Renormalised top-k weights in the router, raw probabilities in gate_weights."""
    plugin = broken(tmp_path, "        if router.norm_topk_prob:\n", "        if False:\n")
    with pytest.raises(AssertionError, match="replayed log-probs differ from the engine's"):
        routing_replay_matches({**CONFIG, "norm_topk_prob": True}, plugins=[plugin])


def test_a_megatron_description_missing_the_dense_layer_is_caught(tmp_path):
    plugin = broken(tmp_path, "dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step)",
                    "dense_layers=()")
    with pytest.raises(AssertionError, match="do not convert as megatron_arch describes"):
        megatron_round_trip(CONFIG, plugins=[plugin], tp=2, ep=2)


def test_megatron_without_the_shared_expert_gate_is_caught(tmp_path):
    plugin = broken(tmp_path, "shared_gate=True", "shared_gate=False")
    with pytest.raises(AssertionError, match="megatron log-probs differ from transformers'"):
        megatron_matches_transformers(CONFIG, plugins=[plugin])
