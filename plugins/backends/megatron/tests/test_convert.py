"""HF <-> Megatron weight conversion: bit-exact round trips for every family, TP and EP layout,
and the shard contents Megatron's parallel layers expect. Pure tensor code: no megatron-core."""
import pytest
import torch
from helpers import hf_model
from miles_plugin_megatron import arch as A
from miles_plugin_megatron import convert as C

LAYOUTS = [("llama", 1, 1), ("llama", 2, 1), ("qwen2", 1, 1), ("qwen2", 2, 1), ("qwen3", 1, 1),
           ("qwen3", 2, 1), ("qwen3_moe", 1, 1), ("qwen3_moe", 2, 1), ("qwen3_moe", 1, 2),
           ("qwen3_moe", 2, 2)]


@pytest.mark.parametrize("family,tp,ep", LAYOUTS)
def test_round_trip_bit_exact(family, tp, ep):
    m = hf_model(family)
    hf, arch = m.state_dict(), A.arch_of(m.config)
    full = C.hf_to_full(hf, arch, tp)
    shards = {(t, e): C.shard(full, arch, tp=tp, tp_rank=t, ep=ep, ep_rank=e)
              for t in range(tp) for e in range(ep)}
    back = C.full_to_hf(C.unshard(shards, arch, tp, ep), arch)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k
        assert back[k].dtype == v.dtype


def test_vocab_padded_for_tp_and_cut_on_export():
    m = hf_model("llama")  # vocab 101: odd, so TP 2 pads one row
    arch = A.arch_of(m.config)
    full = C.hf_to_full(m.state_dict(), arch, tp=2)
    assert full["embedding.word_embeddings.weight"].shape[0] == 102
    assert full["output_layer.weight"][101].abs().sum() == 0
    assert C.full_to_hf(full, arch)["model.embed_tokens.weight"].shape[0] == 101


def test_tp_shards_hold_whole_kv_groups_and_gate_up_halves():
    """TP rank r holds KV groups [r*g/tp, (r+1)*g/tp) with their query heads, and [gate_r; up_r]."""
    m = hf_model("qwen2")
    hf, arch = m.state_dict(), A.arch_of(m.config)
    full = C.hf_to_full(hf, arch)
    d, per, g = arch.head_dim, arch.heads // arch.kv_heads, arch.kv_heads
    for r in range(2):
        s = C.shard(full, arch, tp=2, tp_rank=r)
        qkv = s["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape[0] == (per + 2) * d * g // 2
        first = r * g // 2  # this rank's first KV group: its query heads come first
        a = "model.layers.0.self_attn."
        assert torch.equal(qkv[:per * d], hf[a + "q_proj.weight"][first * per * d:(first + 1) * per * d])
        assert torch.equal(qkv[per * d:(per + 1) * d], hf[a + "k_proj.weight"][first * d:(first + 1) * d])
        assert torch.equal(qkv[(per + 1) * d:(per + 2) * d], hf[a + "v_proj.weight"][first * d:(first + 1) * d])
        bias = s["decoder.layers.0.self_attention.linear_qkv.bias"]
        assert torch.equal(bias[:per * d], hf[a + "q_proj.bias"][first * per * d:(first + 1) * per * d])
        fc1 = s["decoder.layers.0.mlp.linear_fc1.weight"]
        half = arch.ffn // 2
        assert torch.equal(fc1[:half], hf["model.layers.0.mlp.gate_proj.weight"][r * half:(r + 1) * half])
        assert torch.equal(fc1[half:], hf["model.layers.0.mlp.up_proj.weight"][r * half:(r + 1) * half])
        proj = s["decoder.layers.0.self_attention.linear_proj.weight"]
        assert torch.equal(proj, hf[a + "o_proj.weight"][:, r * arch.hidden // 2:(r + 1) * arch.hidden // 2])


def test_expert_shards_use_local_indices():
    m = hf_model("qwen3_moe")
    hf, arch = m.state_dict(), A.arch_of(m.config)
    full = C.hf_to_full(hf, arch)
    s = C.shard(full, arch, ep=2, ep_rank=1)
    experts = sorted(k for k in s if k.startswith("decoder.layers.0.mlp.experts."))
    assert experts == [f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc{n}.weight"
                       for j in range(2) for n in (1, 2)]
    # local expert 0 of EP rank 1 is global expert 2
    assert torch.equal(s["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"],
                       hf["model.layers.0.mlp.experts.down_proj"][2])


def test_per_expert_hf_names_read_and_written():
    """Checkpoints with one gate/up/down per expert (transformers < 5) convert too."""
    m = hf_model("qwen3_moe")
    arch = A.arch_of(m.config)
    fused = C.hf_to_full(m.state_dict(), arch)
    split = C.full_to_hf(fused, arch, fused_experts=False)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in split
    again = C.hf_to_full(split, arch)
    assert all(torch.equal(again[k], v) for k, v in fused.items())


def test_a_partial_layer_of_experts_is_refused():
    m = hf_model("qwen3_moe")
    arch = A.arch_of(m.config)
    full = C.hf_to_full(m.state_dict(), arch)
    part = {k: v for k, v in full.items() if "local_experts.3." not in k}
    with pytest.raises(KeyError, match="3 of 4 experts"):
        C.full_to_hf(part, arch)
