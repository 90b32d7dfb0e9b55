"""DeepSeek-V4 in the megatron trainer (``frontier.py``'s tiny config): hyper-connections (2 residual
streams), sqrt-softplus routing with an expert bias, a hash-routed first MoE layer, and transformers'
own attention (heavily compressed, compressed sparse with its indexer, sliding window) held in
megatron-core's layers. HF <-> Megatron conversion is bit-exact at TP 1/2 x EP 1/2 (the held
attention split by head); one rank's log-probs in fp32 equal transformers' (each row on its
own: V4's compressors ignore the padding mask), each of those parts is live, R3 replays the recorded
experts, optimizer steps lower the loss and a checkpoint resumes. Two TP ranks:
test_frontier_tp2.py."""
from __future__ import annotations

import pytest
import torch
from frontier import CONFIGS, Spec, architecture, check_replay, hf_model, moe_spec, unpadded_logprobs
from frontier_worker import step
from helpers import batch
from miles_plugin_megatron import arch as A
from miles_plugin_megatron import convert as C
from miles_plugin_megatron.config import MegatronConfig

FAMILY = "deepseek_v4"
# Megatron names the conversion must produce: the hash layer's table (and no selection bias), the
# learned layers' bias, the hyper-connections, the compressors and indexer inside the held attention
SHOWN = ("decoder.layers.0.mlp.router.tid2eid", "decoder.layers.1.mlp.router.expert_bias",
         "decoder.layers.0.attn_hc.fn", "decoder.layers.2.ffn_hc.base", "decoder.final_layernorm.hc_fn",
         "decoder.layers.0.self_attention.hf.compressor.position_bias",
         "decoder.layers.1.self_attention.hf.compressor.indexer.q_b_proj.weight",
         "decoder.layers.2.self_attention.hf.sinks", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
         "decoder.layers.2.mlp.experts.local_experts.7.linear_fc2.weight")


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_bit_exact(tp, ep):
    m = hf_model(FAMILY)
    hf = m.state_dict()
    arch = A.arch_of(m.config, architecture(FAMILY))
    assert arch.hc_mult == 2 and arch.hash_layers == (0,) and arch.hf_attention and arch.score == "sqrtsoftplus"
    full = C.hf_to_full(hf, arch, tp)
    assert all(name in full for name in SHOWN) and "decoder.layers.0.mlp.router.expert_bias" not in full
    assert full["decoder.layers.0.mlp.router.tid2eid"].dtype == torch.long
    shards = {(t, e): C.shard(full, arch, tp=tp, tp_rank=t, ep=ep, ep_rank=e) for t in range(tp) for e in range(ep)}
    last = shards[(tp - 1, ep - 1)]
    assert sum(".local_experts." in k for k in last) == 3 * 8 // ep * 2
    # the held attention split by head (what its heads share whole); experts, shared expert and vocabulary split
    shared = "decoder.layers.1.self_attention.hf.compressor.indexer.q_b_proj.weight"
    assert torch.equal(last[shared], full[shared])
    heads = "decoder.layers.1.self_attention.hf.q_b_proj.weight"  # 4 heads x 32
    assert torch.equal(last[heads], full[heads][(tp - 1) * 128 // tp:])
    assert last["decoder.layers.1.self_attention.hf.o_b_proj.weight"].shape == (64, 2 * 16 // tp)  # 2 groups
    for name in ("decoder.layers.2.mlp.experts.local_experts.0.linear_fc2.weight",
                 "decoder.layers.1.mlp.shared_experts.linear_fc2.weight"):
        assert last[name].shape == (64, 32 // tp)
    assert last["embedding.word_embeddings.weight"].shape[0] == arch.padded_vocab(tp) // tp
    back = C.full_to_hf(C.unshard(shards, arch, tp, ep), arch)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


def _trainer(spec, tokenizer=None):
    from miles_plugin_megatron.trainer import MegatronTrainer

    return MegatronTrainer(MegatronConfig(device="cpu", precision="fp32", lr=1e-2, grad_clip=None),
                           spec=spec, tokenizer=tokenizer, seed=0, total_steps=10)


@pytest.fixture(scope="module")
def trainer(megatron_cpu):
    return _trainer(Spec(FAMILY))


def test_logprobs_equal_transformers_and_each_part_is_live(trainer):
    """One rank in fp32: transformers' log-probs; the hash layer takes the table's experts; the
    export is exact; changing any of the table, the expert bias, a hyper-connection, the head,
    the compressor, the indexer or the sinks in transformers changes its log-probs, and loading
    that changed model into the trainer brings both together again."""
    from miles_plugin_megatron.rows import right_aligned
    from replay_helpers import MegatronRouting, as_sets

    tr = trainer
    b = batch(rows=5)
    mask = b.loss_mask.bool()
    hooks = MegatronRouting(tr.model, len(b))
    lp = tr.logprobs(b)
    hooks.close()
    hf = hf_model(FAMILY)
    assert (lp - unpadded_logprobs(hf, b))[mask].abs().max() < 1e-5
    ids, _ = right_aligned(b)
    table = hf.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(hooks.maps[0], as_sets(table[ids], 8))  # every token, padding included
    hs = hf.state_dict()
    exported = dict(tr.named_weights())
    assert set(exported) == set(hs) and all(torch.equal(exported[k], v) for k, v in hs.items())
    changes = {"mlp.gate.tid2eid": lambda t: t.roll(1, 0), "layers.1.mlp.gate.e_score_correction_bias": lambda t: -t,
               "layers.1.attn_hc.base": lambda t: t + 1, "hc_head.hc_base": lambda t: t + 1,
               "layers.0.self_attn.compressor.position_bias": lambda t: -t,
               "compressor.indexer.q_b_proj.weight": lambda t: -t, "layers.2.self_attn.sinks": lambda t: t + 2}
    changed = dict(hs)
    for part, change in changes.items():
        keys = [k for k in hs if k.endswith(part)]
        assert keys, part
        hf.load_state_dict({**hs, **{k: change(hs[k]) for k in keys}})
        assert (lp - unpadded_logprobs(hf, b))[mask].abs().max() > 1e-4, part
        changed.update({k: change(hs[k]) for k in keys})
    hf.load_state_dict(changed)
    tr.load_weights(changed.items())
    assert (tr.logprobs(b) - unpadded_logprobs(hf, b))[mask].abs().max() < 1e-5
    tr.load_weights(hs.items())


def test_steps_lower_the_loss_and_a_checkpoint_resumes(trainer, tmp_path):
    tr = trainer
    b = batch(rows=5)
    losses = [step(tr, b)["loss"] for _ in range(3)]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    tr.save(str(tmp_path / "ckpt"))
    lp = tr.logprobs(b)
    fresh = _trainer(Spec(FAMILY))
    assert (fresh.logprobs(b) - lp).abs().max() > 1e-3
    fresh.load(str(tmp_path / "ckpt"))
    assert (fresh.logprobs(b) - lp).abs().max() < 1e-6
    assert step(fresh, b)["loss"] == pytest.approx(step(tr, b)["loss"], abs=1e-6)  # the AdamW moments too


def test_routing_replay(megatron_cpu):
    """R3 with DeepSeek-V4 (the ``moe`` spec over it): every MoE router, the hash-routed one too,
    takes the recorded experts, and the log-probs equal the spec's replaying transformers forward."""
    from replay_helpers import Tok

    assert CONFIGS[FAMILY]["mlp_layer_types"][0] == "hash_moe"
    spec = moe_spec(FAMILY)
    check_replay(_trainer(spec, Tok()), spec, batch(rows=4), (0, 1, 2))


def test_a_critic_is_refused(megatron_cpu):
    """PPO's value head reads one hidden state; V4's backbone ends in its streams."""
    from miles import MilesError
    from miles_plugin_megatron.critic import MegatronCriticTrainer

    with pytest.raises(MilesError, match=r"critic over deepseek_v4's 2 hyper-connection streams"):
        MegatronCriticTrainer(MegatronConfig(device="cpu", precision="fp32"), spec=Spec(FAMILY), tokenizer=None)
