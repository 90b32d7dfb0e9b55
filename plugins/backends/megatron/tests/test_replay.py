"""Rollout routing replay (R3) in the megatron trainer, on CPU through tests/cpu_shim.py: with the
``moe`` model spec's routing replay on, megatron-core's routers use exactly the recorded experts
(prompt and response tokens), their gate weights come from the trainer's own router logits (the
router gets the gradient the fsdp2 path gives it), and both trainers pick the same experts."""
import pytest
import torch
from helpers import batch
from miles_plugin_megatron.config import MegatronConfig
from replay_helpers import MOE, HFRouting, MegatronRouting, Tok, as_sets, r3_spec, record

E, LAYERS = MOE["num_experts"], MOE["num_hidden_layers"]


def megatron(spec, **cfg):
    from miles_plugin_megatron.trainer import MegatronTrainer

    cfg = MegatronConfig(device="cpu", precision="fp32", **{"lr": 1e-3, **cfg})
    return MegatronTrainer(cfg, spec=spec, tokenizer=Tok(), seed=0, total_steps=10)


def fsdp2(spec, named):
    """The fsdp2 trainer of the same run (world size 1), holding ``named`` weights."""
    from miles import make_plugin_manager

    pm = make_plugin_manager()
    tr = pm.create("trainers", "fsdp2", pm.registry("trainers")["fsdp2"].config(lr=1e-3),
                   spec=spec, tokenizer=Tok(), seed=0, total_steps=10)
    tr.load_weights(named)
    return tr


def recorded(b):
    """``(row, sample, its recorded experts or None)`` of every row."""
    for row, s in enumerate(b.samples):
        rec = (s.extensions.get("moe") or {}).get("routed_experts")
        yield row, s, rec


def test_megatron_routers_use_exactly_the_recorded_experts(megatron_cpu):
    tr = megatron(r3_spec())
    assert tr.replay is not None and tr.replay.extension == "moe"
    b = batch(rows=4)
    plain = tr.logprobs(b)  # no records yet: routed as usual
    hooks = MegatronRouting(tr.model, len(b))
    tr.logprobs(b)
    own = dict(hooks.maps)
    record(b, skip=(1,))
    replayed = tr.logprobs(b)
    hooks.close()
    flipped = 0
    for row, s, rec in recorded(b):
        n = len(s.prompt_ids) + len(s.response_ids)
        for layer in range(LAYERS):
            got = hooks.maps[layer][row]
            if rec is None:  # a sample without a record: routed as usual
                assert torch.equal(got[:n], own[layer][row, :n])
                continue
            want = as_sets(rec[:, layer], E)
            assert torch.equal(got[:len(rec)], want)  # every prompt and response token but the last
            assert torch.equal(got[len(rec):n], own[layer][row, len(rec):n])  # the last: its own choice
            flipped += int((want != own[layer][row, :len(rec)]).any(-1).sum())
    assert flipped > 10  # the records differ from the trainer's own routing on many tokens
    mask = b.loss_mask.bool()
    assert (replayed - plain)[mask].abs().max() > 1e-3  # ... and replaying them changes the output
    assert torch.equal(replayed[1], plain[1])  # the unrecorded sample is unchanged


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalised", "softmax_over_all"])
def test_megatron_and_fsdp2_replay_the_same_experts_and_train_the_router_alike(megatron_cpu, norm_topk_prob):
    """The same recorded ids through both trainers: the same expert sets per token and layer, the
    same log-probs, and the same gradient on every router (the gate weights are recomputed from
    each trainer's own router logits over the recorded experts, so the router still learns)."""
    spec = r3_spec(norm_topk_prob=norm_topk_prob)
    mt = megatron(spec)
    named = dict(mt.named_weights())
    ft = fsdp2(spec, named)
    b = batch(rows=4)
    record(b, skip=(2,))
    m_hooks, h_hooks = MegatronRouting(mt.model, len(b)), HFRouting(ft.model, len(b), E)
    lp_m = mt._scored(mt.model, b)
    lp_f = ft.logprobs(b)
    assert ((lp_m.detach() - lp_f) * b.loss_mask).abs().max() < 1e-5
    for row, s, rec in recorded(b):
        lead = b.prompt_len - len(s.prompt_ids)
        n = len(rec) if rec is not None else len(s.prompt_ids) + len(s.response_ids)
        for layer in range(LAYERS):
            assert torch.equal(m_hooks.maps[layer][row, :n], h_hooks.maps[layer][row, lead:lead + n])
            if rec is not None:
                assert torch.equal(m_hooks.maps[layer][row, :n], as_sets(rec[:, layer], E))
    m_hooks.close(), h_hooks.close()
    # the router gradient of a policy-gradient-like loss, megatron vs the fsdp2 path (the spec's
    # replaying forward, which the fsdp2 trainer scores with)
    (-(lp_m * b.advantages * b.loss_mask).sum()).backward()
    lp_h = spec.action_logprobs(ft.model, b)
    (-(lp_h * b.advantages * b.loss_mask).sum()).backward()
    for layer in range(LAYERS):
        g_m = dict(mt.model.named_parameters())[f"decoder.layers.{layer}.mlp.router.weight"].grad
        g_h = ft.model.get_parameter(f"model.layers.{layer}.mlp.gate.weight").grad
        assert g_m is not None and g_m.abs().max() > 1e-4  # the gate gradient reaches the router
        assert (g_m - g_h).abs().max() < 1e-5 * max(1.0, float(g_h.abs().max())) + 1e-6


def test_a_record_of_another_model_is_a_clear_error(megatron_cpu):
    from miles import MilesError

    tr = megatron(r3_spec())
    b = batch(rows=2)
    b.samples[0].extensions["moe"] = {"routed_experts": torch.zeros(4, LAYERS + 1, 2, dtype=torch.int32)}
    with pytest.raises(MilesError, match="routing_replay=false"):
        tr.logprobs(b)
    b.samples[0].extensions["moe"] = {"routed_experts": torch.full((4, LAYERS, 2), E, dtype=torch.int32)}
    with pytest.raises(MilesError, match=f"has {E} experts"):
        tr.logprobs(b)


def test_routing_replay_off_routes_as_usual(megatron_cpu):
    tr = megatron(r3_spec(replay=False))
    assert tr.replay is None
    b = batch(rows=2)
    plain = tr.logprobs(b)
    record(b, skip=())
    assert torch.equal(tr.logprobs(b), plain)  # records are ignored when the run does not replay


def test_miles_train_with_routing_replay(megatron_cpu, tmp_path, monkeypatch):
    """``miles train`` with the ``moe`` spec (routing replay on) and ``trainer.name: megatron``: the
    engine's records reach the trainer with every sample, and the engine's and the trainer's
    log-probs agree (both in fp32, the trainer replaying the engine's experts)."""
    import json
    from pathlib import Path

    from miles.cli import main

    here, probe = Path(__file__).parent, tmp_path / "probe.txt"
    monkeypatch.setenv("MILES_R3_PROBE", str(probe))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model: {name: moe, routing_replay: true, base: {name: hf, config: {model_type: qwen3_moe, "
        "hidden_size: 64, intermediate_size: 128, moe_intermediate_size: 32, num_experts: 4, "
        "num_experts_per_tok: 2, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
        "head_dim: 16, max_position_embeddings: 32, tie_word_embeddings: true}}}\n"
        "env: {name: arith, digits: 2, eval_size: 8}\n"
        "rollout: {batch_size: 4, n: 2, temperature: 1.0, max_new_tokens: 4}\n"
        "engine: {name: torch}\nalgorithm: {name: grpo, filter_zero_variance: false}\n"
        "trainer: {name: megatron, device: cpu, precision: fp32, lr: 1.0e-3, micro_batch_size: 4}\n"
        "sync: {name: tensor}\n"
        f"run: {{steps: 2, out_dir: {tmp_path / 'out'}, eval_every: 100, threads: 2}}\n")
    assert main(["train", str(cfg), "--plugin", str(here / "r3_probe.py")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert max(r["train_rollout_logprob_abs_diff"] for r in steps) < 1e-4
    seen = [tuple(map(int, line.split())) for line in probe.read_text().splitlines()]
    assert len(seen) == 4 and all(rec == n == 4 for rec, n in seen)  # 2 steps x 2 micro-batches of 4
