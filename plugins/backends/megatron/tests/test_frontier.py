"""DeepSeek-V3 (multi-latent attention) and GLM-4.5 (partial RoPE, q/k norms, QKV biases) in the
megatron trainer, each described by its architecture plugin (``BuildsMegatron``): sigmoid routing
with a selection-only expert bias, group-limited top-k, shared experts and a dense first layer; and
gpt-oss (attention sinks, sliding-window layers, YaRN, biased experts with a clamped SwiGLU); GLM-5
(MLA with DeepSeek sparse attention's indexer).
HF <-> Megatron conversion is bit-exact at TP 1/2 x EP 1/2; log-probs equal transformers' in fp32
on one rank and on two gloo ranks (TP=2, EP=2 x DP=2; gpt-oss: EP=2, its TP=2 in
test_frontier_tp2.py), where a step also matches one rank's (loss, gradient norm, log-probs after)."""
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from frontier import CONFIGS, GATED, Spec, architecture, check_replay, hf_model, moe_spec
from frontier_worker import CASES
from helpers import batch, hf_logprobs
from miles import MilesError
from miles_plugin_megatron import arch as A
from miles_plugin_megatron import convert as C
from miles_plugin_megatron.config import MegatronConfig

HERE = Path(__file__).parent
FAMILIES = ("deepseek_v3", "glm4_moe")
# Megatron weights each family's conversion must produce
SHOWN = {family: ("decoder.layers.0.mlp.linear_fc1.weight",  # the dense first layer
                  "decoder.layers.1.mlp.router.expert_bias", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight")
         for family in FAMILIES}
SHOWN["gpt_oss"] = ("decoder.layers.0.self_attention.core_attention.softmax_offset",
                    "decoder.layers.0.self_attention.linear_proj.bias", "decoder.layers.1.mlp.router.bias",
                    "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.bias",
                    "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.bias")
SHOWN["glm_moe_dsa"] = (*SHOWN["deepseek_v3"],
                        "decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.weight",
                        "decoder.layers.2.self_attention.core_attention.indexer.k_norm.bias",
                        "decoder.layers.2.self_attention.core_attention.indexer.linear_weights_proj.weight")


@pytest.mark.parametrize("family", [*FAMILIES, "gpt_oss", "glm_moe_dsa"])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_bit_exact(family, tp, ep):
    m = hf_model(family)
    hf = {k: v for k, v in m.state_dict().items() if not k.startswith("model.layers.3.")}  # MTP: carried apart
    arch = A.arch_of(m.config, architecture(family))
    full = C.hf_to_full(hf, arch, tp)
    assert all(name in full for name in SHOWN[family])
    shards = {(t, e): C.shard(full, arch, tp=tp, tp_rank=t, ep=ep, ep_rank=e) for t in range(tp) for e in range(ep)}
    back = C.full_to_hf(C.unshard(shards, arch, tp, ep), arch)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


def test_a_family_without_megatron_description_is_refused():
    from transformers import AutoConfig

    with pytest.raises(MilesError, match="qwen3_next.*architecture plugin builds Megatron"):
        A.arch_of(AutoConfig.for_model("qwen3_next"), None)


def test_deepseek_v4_what_megatron_cannot_build_is_refused():
    """DeepSeek-V4 builds (test_deepseek_v4.py); its held attention splits over tensor-parallel ranks
    by head in whole output groups (its one KV head shared, whole on each) and does not train in
    fp8, its residual streams are not sent between pipeline stages, and its routers score by
    sqrt-softplus only."""
    from miles.protocols import BuildsMegatron
    from miles_plugin_megatron import parallel
    from transformers import AutoConfig

    def config(**over):
        return AutoConfig.for_model("deepseek_v4", **{**CONFIGS["deepseek_v4"], **over})

    v4 = architecture("deepseek_v4")
    assert isinstance(v4, BuildsMegatron)
    arch = A.arch_of(config(), v4)
    assert arch.hc_mult == 2 and arch.hf_attention
    parallel.check_layout(MegatronConfig(device="cpu", expert_parallel=2), arch, 2)
    parallel.check_layout(MegatronConfig(device="cpu", tensor_parallel=2), arch, 2)
    with pytest.raises(MilesError, match=r"tensor_parallel=2 does not divide the model's 1 output groups"):
        parallel.check_layout(MegatronConfig(device="cpu", tensor_parallel=2), A.arch_of(config(o_groups=1), v4), 2)
    with pytest.raises(MilesError, match=r"tensor_parallel=2 does not divide moe_intermediate_size 33"):
        parallel.check_layout(MegatronConfig(device="cpu", tensor_parallel=2),
                              A.arch_of(config(moe_intermediate_size=33), v4), 2)
    with pytest.raises(MilesError, match=r"pipeline_parallel=3: .*model.config.hc_mult"):
        parallel.check_layout(MegatronConfig(device="cpu", pipeline_parallel=3), arch, 3)
    with pytest.raises(MilesError, match="scoring_func 'sigmoid'"):
        A.arch_of(config(scoring_func="sigmoid"), v4)
    from miles_plugin_megatron import lowp

    with pytest.raises(MilesError, match="fp8 .* this model has transformers' own attention module"):
        lowp.check_arch(MegatronConfig(device="cpu", precision="fp8"), arch)


def test_groups_are_ranked_by_their_two_best_experts_as_in_transformers(megatron_cpu):
    """Top-2 of 8 experts in 4 groups, 2 groups chosen (recipes/arch/deepseek.yaml's routing):
    megatron-core ranks a group by its best expert alone, transformers by its two best. The
    trainer's router ranks as transformers does: equal log-probs, and routing maps that differ
    from megatron-core's own on random logits."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from miles_plugin_megatron.trainer import MegatronTrainer

    over = {"n_group": 4, "topk_group": 2}
    tr = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32"), spec=Spec("deepseek_v3", **over),
                         tokenizer=None)
    b = batch(rows=5)
    assert (tr.logprobs(b) - hf_logprobs(hf_model("deepseek_v3", **over), b))[b.loss_mask.bool()].abs().max() < 1e-5
    router = tr.model.decoder.layers[1].mlp.router
    logits = torch.randn(256, 1, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, ours = router.routing(logits)
        _, core = topk_routing_with_score_function(logits.view(-1, 8), 2, num_groups=4, group_topk=2,
                                                   score_function="sigmoid", expert_bias=router.expert_bias)
    assert (ours != core).any(-1).sum() > 10


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_transformers_and_export_is_exact(megatron_cpu, family):
    from miles_plugin_megatron.trainer import MegatronTrainer

    tr = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32"), spec=Spec(family), tokenizer=None)
    assert tr.arch.family == family and tr.arch.dense_layers == (0,) and tr.arch.score == "sigmoid"
    assert tr.arch.mla == (family == "deepseek_v3")
    b = batch(rows=5)
    hf = hf_model(family)
    diff = (tr.logprobs(b) - hf_logprobs(hf, b))[b.loss_mask.bool()].abs().max()
    assert diff < 1e-5
    exported, hs = dict(tr.named_weights()), hf.state_dict()
    assert set(exported) == set(hs) and "model.layers.3.eh_proj.weight" in hs  # the MTP layer carried
    assert all(torch.equal(exported[k], v) for k, v in hs.items())
    # the bias steers the choice: without it the experts (and so the log-probs) differ
    hf.load_state_dict({k: (torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v)
                        for k, v in hs.items()})
    assert (tr.logprobs(b) - hf_logprobs(hf, b))[b.loss_mask.bool()].abs().max() > 1e-4


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", "29531", str(HERE / "frontier_worker.py"), str(out)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,ep", CASES)
def test_two_ranks_match_transformers_and_one_rank(two_ranks, megatron_cpu, family, tp, ep):
    from frontier_worker import case_batch, step
    from miles_plugin_megatron.trainer import MegatronTrainer

    ranks = [torch.load(two_ranks / f"{family}_tp{tp}_ep{ep}_rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        assert r["export_equal"] and r["lp_diff"] < 1e-5
    one = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32", lr=1e-3, grad_clip=None),
                          spec=Spec(family), tokenizer=None, seed=0, total_steps=10)
    b = case_batch(family)
    m = step(one, b)
    assert abs(m["loss"] - ranks[0]["loss"]) < 1e-6
    assert abs(m["grad_norm"] - ranks[0]["grad_norm"]) < 1e-5 * m["grad_norm"]  # AdamW's step is scale-blind
    assert (one.logprobs(b) - ranks[0]["after"]).abs().max() < 1e-5


def test_gpt_oss_logprobs_equal_transformers_and_steps_lower_the_loss(megatron_cpu):
    """gpt-oss on one rank: megatron-core's forward equals transformers' with the sinks, the window,
    the clamped SwiGLU and YaRN, each of which changes the log-probs (transformers without it
    differs); the export is exact, and optimizer steps lower the loss."""
    from frontier_worker import step
    from miles_plugin_megatron.trainer import MegatronTrainer

    tr = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32", lr=1e-2, grad_clip=None),
                         spec=Spec("gpt_oss"), tokenizer=None, seed=0, total_steps=10)
    assert tr.arch.sinks and tr.arch.window_layers == (0,) and tr.arch.yarn_factor == 4.0
    b = batch(rows=5)
    mask = b.loss_mask.bool()
    lp = tr.logprobs(b)
    hf = hf_model("gpt_oss")
    assert (lp - hf_logprobs(hf, b))[mask].abs().max() < 1e-5
    exported, hs = dict(tr.named_weights()), hf.state_dict()
    assert set(exported) == set(hs) and all(torch.equal(exported[k], v) for k, v in hs.items())
    plain_rope = {"rope_type": "default", "rope_theta": 10000.0}
    for over in ({"sliding_window": 64}, {"swiglu_limit": 7.0}, {"rope_parameters": plain_rope}):
        assert (lp - hf_logprobs(hf_model("gpt_oss", **over), b))[mask].abs().max() > 1e-4, over
    hf.load_state_dict({k: (torch.zeros_like(v) if k.endswith("sinks") else v) for k, v in hs.items()})
    assert (lp - hf_logprobs(hf, b))[mask].abs().max() > 1e-4
    losses = [step(tr, b)["loss"] for _ in range(4)]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_gpt_oss_what_megatron_core_cannot_build_is_refused():
    from miles_plugin_megatron import parallel
    from transformers import AutoConfig

    def config(**over):
        return AutoConfig.for_model("gpt_oss", **{**CONFIGS["gpt_oss"], **over})

    arch = A.arch_of(config(), architecture("gpt_oss"))
    # its biased experts stay whole on every TP rank (expert tensor parallel 1): any expert size splits
    assert arch.whole_experts and arch.expert_tp(2) == 1
    parallel.check_layout(MegatronConfig(device="cpu", tensor_parallel=2), A.arch_of(config(intermediate_size=33),
                                                                                     architecture("gpt_oss")), 2)
    with pytest.raises(MilesError, match="tensor_parallel=2 does not divide the model's 3 KV heads"):
        parallel.check_layout(MegatronConfig(device="cpu", tensor_parallel=2),
                              A.arch_of(config(num_key_value_heads=3, num_attention_heads=6),
                                        architecture("gpt_oss")), 2)
    yarn = {**CONFIGS["gpt_oss"]["rope_parameters"], "attention_factor": 2.0}
    with pytest.raises(MilesError, match="rope_parameters.attention_factor=2.0"):
        A.arch_of(config(rope_parameters=yarn), architecture("gpt_oss"))
    with pytest.raises(MilesError, match="attention_bias: false"):
        A.arch_of(config(attention_bias=False), architecture("gpt_oss"))


def test_gpt_oss_routing_replay(megatron_cpu):
    """R3 with gpt-oss (the ``moe`` spec over it): megatron-core's routers take the recorded experts,
    and the log-probs equal the spec's replaying transformers forward."""
    from miles_plugin_megatron.trainer import MegatronTrainer
    from replay_helpers import Tok

    spec = moe_spec("gpt_oss")
    tr = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32"), spec=spec, tokenizer=Tok(), seed=0)
    check_replay(tr, spec, batch(rows=4), (0, 1))


# -- Qwen3-Next and Qwen3.5 MoE: gated DeltaNet, gated attention, zero-centred norms ------------------
@pytest.mark.parametrize("family", GATED)
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_gated_round_trip_bit_exact(family, tp, ep):
    """Qwen3-Next's per-key-head packed DeltaNet projections and Qwen3.5's split ones both become
    megatron-core's ``in_proj`` ``[q; k; v; z; b; a]``; q_proj's per-head query/gate rows become
    gated ``linear_qkv`` groups; a TP rank holds its heads' slice of each DeltaNet part."""
    m = hf_model(family)
    hf = m.state_dict()
    arch = A.arch_of(m.config, architecture(family))
    assert arch.linear_layers == (0, 2) and arch.attention_gate and arch.zero_centered_norms and arch.shared_gate
    full = C.hf_to_full(hf, arch, tp)
    in_proj = full["decoder.layers.0.self_attention.in_proj.weight"]
    assert in_proj.shape == (2 * 16 + 2 * 32 + 2 * 4, 64)  # q, k: 2 heads x 8; v, z: 4 x 8; b, a: 4
    assert full["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((2 * 4 + 2 * 2) * 16, 64)
    assert "decoder.layers.2.mlp.shared_experts.gate_weight" in full
    shards = {(t, e): C.shard(full, arch, tp=tp, tp_rank=t, ep=ep, ep_rank=e) for t in range(tp) for e in range(ep)}
    if tp == 2:  # rank 1: key head 1's q and k rows, value heads 2-3 (v, z, b, a)
        mine = shards[(1, 0)]["decoder.layers.0.self_attention.in_proj.weight"]
        cut = [in_proj[8:16], in_proj[24:32], in_proj[48:64], in_proj[80:96], in_proj[98:100], in_proj[102:104]]
        assert torch.equal(mine, torch.cat(cut))
    back = C.full_to_hf(C.unshard(shards, arch, tp, ep), arch)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("family", GATED)
def test_gated_logprobs_equal_transformers_and_steps_lower_the_loss(megatron_cpu, family):
    """One rank in fp32: the DeltaNet module (transformers' chunked delta rule, causal conv, gated
    norm), megatron-core's gated attention and gated shared expert and the zero-centred norms give
    transformers' log-probs, each part live (transformers with it changed differs); the export is
    exact and optimizer steps lower the loss."""
    from frontier_worker import step
    from miles_plugin_megatron.trainer import MegatronTrainer

    tr = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32", lr=1e-3, grad_clip=None),
                         spec=Spec(family), tokenizer=None, seed=0, total_steps=10)
    assert tr.arch.dense_layers == ((0,) if family == "qwen3_next" else ())
    b = batch(rows=5)
    mask = b.loss_mask.bool()
    lp = tr.logprobs(b)
    hf = hf_model(family)
    assert (lp - hf_logprobs(hf, b))[mask].abs().max() < 1e-5
    exported, hs = dict(tr.named_weights()), hf.state_dict()
    assert set(exported) == set(hs) and all(torch.equal(exported[k], v) for k, v in hs.items())
    for part in ("linear_attn.A_log", "linear_attn.norm.weight", "shared_expert_gate.weight",
                 "self_attn.q_norm.weight"):
        hf.load_state_dict({k: (v + 0.5 if k.endswith(part) else v) for k, v in hs.items()})
        assert (lp - hf_logprobs(hf, b))[mask].abs().max() > 1e-4, part
    losses = [step(tr, b)["loss"] for _ in range(4)]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_gated_what_megatron_cannot_build_is_refused():
    from miles_plugin_megatron import parallel
    from transformers import AutoConfig

    def arch(**over):
        config = AutoConfig.for_model("qwen3_next", **{**CONFIGS["qwen3_next"], **over})
        return A.arch_of(config, architecture("qwen3_next"))

    with pytest.raises(MilesError, match="tensor_parallel=2 does not divide the model's 3 linear_num_key_heads"):
        parallel.check_layout(MegatronConfig(device="cpu", tensor_parallel=2), arch(linear_num_key_heads=3,
                                                                                  linear_num_value_heads=6), 2)
    parallel.check_layout(MegatronConfig(device="cpu", tensor_parallel=2), arch(), 2)  # 2 and 4 heads split
    with pytest.raises(MilesError, match="attention_bias: true"):
        arch(attention_bias=True)


def test_gated_routing_replay(megatron_cpu):
    """R3 with Qwen3-Next (the ``moe`` spec over it, a dense first layer): megatron-core's routers of
    the MoE layers take the recorded experts, and the log-probs equal the spec's replaying
    transformers forward."""
    from miles_plugin_megatron.trainer import MegatronTrainer
    from replay_helpers import Tok

    spec = moe_spec("qwen3_next")
    tr = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32"), spec=spec, tokenizer=Tok(), seed=0)
    check_replay(tr, spec, batch(rows=4), (1, 2))


@pytest.mark.slow
def test_gated_tp2_checkpoint_resumes_on_one_rank(two_ranks, megatron_cpu):
    """A TP=2 checkpoint (each rank's slice of every DeltaNet part, stored part by part as
    megatron-core's GatedDeltaNet stores them) loads on one rank to the same log-probs."""
    from miles_plugin_megatron.trainer import MegatronTrainer

    one = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32"), spec=Spec("qwen3_next"), tokenizer=None)
    b = batch(rows=5)
    saved = torch.load(two_ranks / "qwen3_next_tp2_ep1_rank0.pt", weights_only=False)["changed"]
    assert (one.logprobs(b) - saved).abs().max() > 1e-3
    one.load(str(two_ranks / "qwen3_next_tp2_checkpoint"))
    assert (one.logprobs(b) - saved).abs().max() < 1e-5


# -- GLM-5: multi-latent attention with DeepSeek sparse attention's indexer ------------------------------
def _glm5_trainer(spec: Any, tokenizer: Any = None) -> Any:
    from miles_plugin_megatron.trainer import MegatronTrainer

    return MegatronTrainer(MegatronConfig(device="cpu", precision="fp32", lr=1e-3, grad_clip=None),
                           spec=spec, tokenizer=tokenizer, seed=0, total_steps=10)


def test_glm5_logprobs_equal_transformers_keys_dropped_and_steps_lower_the_loss(megatron_cpu):
    """GLM-5 on one rank in fp32, over rows of up to 18 tokens of which the indexer keeps 6 per
    query: the sparse core attention gives transformers' log-probs, the selection is live (dense
    attention or another indexer key projection differ), the export is exact and steps lower the loss."""
    from frontier_worker import step
    from miles_plugin_glm.megatron_dsa import Indexer

    tr = _glm5_trainer(Spec("glm_moe_dsa"))
    assert tr.arch.mla and tr.arch.index_topk == 6 and tr.arch.dense_layers == (0,)
    b = batch(rows=4, prompt=8, response=8)
    mask = b.loss_mask.bool()
    kept = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: kept.append(out)) for m in tr.model.modules()
             if isinstance(m, Indexer)]
    lp = tr.logprobs(b)
    for h in hooks:
        h.remove()
    assert len(kept) == 3
    s = kept[0].shape[-1]
    causal = torch.arange(s)[:, None] >= torch.arange(s)[None]
    for k in kept:  # every query keeps its 6 best causal keys, so later queries drop some
        assert not (k & ~causal).any() and torch.equal(k.sum(-1), causal.sum(-1).clamp(max=6).expand_as(k[..., 0]))
    hf = hf_model("glm_moe_dsa")
    assert (lp - hf_logprobs(hf, b))[mask].abs().max() < 1e-5
    exported, hs = dict(tr.named_weights()), hf.state_dict()
    assert set(exported) == set(hs) and all(torch.equal(exported[k], v) for k, v in hs.items())
    indexer = {k: v.clone() for k, v in hs.items() if ".indexer." in k}
    assert (lp - hf_logprobs(hf_model("glm_moe_dsa", index_topk=64), b))[mask].abs().max() > 1e-4
    hf.load_state_dict({k: (v.flip(0) if k.endswith("indexer.wk.weight") else v) for k, v in hs.items()})
    assert (lp - hf_logprobs(hf, b))[mask].abs().max() > 1e-4
    losses = [step(tr, b)["loss"] for _ in range(4)]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    exported = dict(tr.named_weights())  # the indexer does not train (no gradient, as in transformers)
    assert all(torch.equal(exported[k], v) for k, v in indexer.items())


def test_glm5_what_megatron_cannot_build_is_refused():
    from transformers import AutoConfig

    def arch(**over):
        return A.arch_of(AutoConfig.for_model("glm_moe_dsa", **{**CONFIGS["glm_moe_dsa"], **over}),
                         architecture("glm_moe_dsa"))

    assert arch(mlp_layer_types=["dense", "sparse", "dense"]).dense_layers == (0, 2)
    with pytest.raises(MilesError, match="indexer_types with 'shared' layers"):
        arch(indexer_types=["full", "shared", "full"])
    with pytest.raises(MilesError, match="attention_bias: true"):
        arch(attention_bias=True)


def test_glm5_routing_replay(megatron_cpu):
    """R3 with GLM-5 (the ``moe`` spec over it, a dense first layer): megatron-core's routers of the MoE
    layers take the recorded experts, and the log-probs equal the spec's replaying transformers forward."""
    from replay_helpers import Tok

    spec = moe_spec("glm_moe_dsa")
    check_replay(_glm5_trainer(spec, Tok()), spec, batch(rows=4, prompt=8, response=8), (1, 2))

