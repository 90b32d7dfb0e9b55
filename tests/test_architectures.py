"""The frontier architectures the model-family plugins register (deepseek, glm, qwen3-next, gpt-oss),
each at a tiny random size through miles' own path: ``model.name: hf`` / ``moe`` with an inline
config, the torch engine's generic path, routing replay and the fsdp2 trainer. The reference is
transformers' own forward of the same tokens."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from miles import Batch, SamplingParams, make_plugin_manager
from miles.protocols import Architecture, KnowsArchitecture, RoutesExperts
from miles.testing import char_tokenizer
from miles.testing.arch import reference_logprobs
from miles_tinypolicy.frontier import FAMILIES, frontier_config, lively

PROMPTS = [[2, 5, 6, 7, 8, 9, 10, 11, 12, 13], [2, 11], [2, 12, 13, 14, 15]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls gain nothing from threads on a shared CPU
    yield
    torch.set_num_threads(before)


def make_spec(model_type: str, replay: bool):
    pm = make_plugin_manager()
    config = frontier_config(model_type)
    if not replay:
        settings = pm.registry("model_specs")["hf"].config(config=config)
        return pm.create("model_specs", "hf", settings, pm=pm)
    settings = pm.registry("model_specs")["moe"].config(base={"name": "hf", "config": config})
    return pm.create("model_specs", "moe", settings, pm=pm)


def make_engine(spec, tok):
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    engine = TorchEngine(TorchEngineConfig(impl="hf"), spec=spec, tokenizer=tok, seed=0)
    engine.load_weights(lively(engine.model), version=1)
    return engine


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_model_type_has_its_architecture(model_type):
    spec = make_spec(model_type, replay=False)
    assert isinstance(spec, KnowsArchitecture)
    arch = spec.architecture()
    assert isinstance(arch, Architecture) and isinstance(arch, RoutesExperts)
    assert arch.check_config(frontier_config(model_type)) == []


def test_an_inline_config_the_architecture_cannot_build_is_a_config_error(tmp_path, capsys):
    import yaml
    from miles.cli import main

    recipe = yaml.safe_load((RECIPES / "deepseek.yaml").read_text())
    recipe["model"] = {"name": "hf", "config": {**recipe["model"]["base"]["config"], "n_group": 3}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(tmp_path / "bad.yaml"), f"run.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr()
    assert "n_routed_experts (8) must be a multiple of n_group (3)" in err.out + err.err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_engine_logprobs_equal_a_transformers_forward(model_type, tok):
    """Left-padded prompts of different lengths, 2 samples each sharing their prompt's prefill,
    decoded over the architecture's own cache."""
    engine = make_engine(make_spec(model_type, replay=False), tok)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), n=2)
    assert [len(o) for o in outs] == [2, 2, 2]
    worst = 0.0
    for prompt, comps in zip(PROMPTS, outs):
        for comp in comps:
            assert comp.token_ids
            want = reference_logprobs(engine.model, prompt, comp.token_ids)
            worst = max(worst, (want - torch.tensor(comp.logprobs)).abs().max().item())
    assert worst < 1e-5, f"{model_type}: engine log-probs differ from transformers' forward by {worst:.2e}"


@pytest.fixture(scope="module")
def rollouts(tok):
    """Per model type: the R3 spec, its engine and a batch of recorded samples (built on first use)."""
    from miles import Sample, Task

    built = {}

    def get(model_type):
        if model_type not in built:
            spec = make_spec(model_type, replay=True)
            engine = make_engine(spec, tok)
            outs = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6), n=2)
            samples = [Sample(Task("x"), prompt_ids=p, response_ids=c.token_ids, logprobs=c.logprobs,
                              extensions=dict(c.extras)) for p, cs in zip(PROMPTS, outs) for c in cs]
            batch = Batch.from_samples(samples, pad_id=tok.pad_token_id, advantages=[1.0] * len(samples))
            built[model_type] = spec, engine, batch
        return built[model_type]
    return get


def trainer_copy(spec, engine, tok):
    model = spec.build_model(tok)
    model.load_state_dict(engine.model.state_dict())
    return model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_replaying_recorded_experts_reproduces_the_forward_and_random_experts_change_it(model_type, rollouts, tok):
    from miles_plugin_moe.spec import routing_state

    spec, engine, batch = rollouts(model_type)
    state = routing_state(engine.model)
    for s in batch.samples:
        rec = s.extensions["moe"]["routed_experts"]
        assert tuple(rec.shape) == (len(s.prompt_ids) + len(s.response_ids) - 1, state.num_layers, state.top_k)
    model = trainer_copy(spec, engine, tok)
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        replayed = spec.action_logprobs(model, batch)
        assert (replayed - batch.rollout_logprobs)[mask].abs().max() < 1e-5
        # the trainer's own routing, recorded and replayed: the same forward, bit for bit
        own = routing_state(model)
        with own.recording():
            plain = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids, use_cache=False).logits
        experts = own.take()[0]
        with own.replaying(experts):
            again = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids, use_cache=False).logits
        assert torch.equal(plain, again)
        g = torch.Generator().manual_seed(0)
        with own.replaying(torch.randint(0, state.num_experts, experts.shape, generator=g)):
            other = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids, use_cache=False).logits
        assert (other - plain).abs().max() > 1e-3
    # gate weights come from the trainer's own router logits: gradients reach the routers
    spec.action_logprobs(model, batch)[mask].sum().backward()
    routers = spec.architecture().routers(model)
    assert any(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fsdp2_trains_with_routing_replay(model_type, rollouts, tok):
    from miles_plugin_fsdp2.config import FSDP2Config
    from miles_plugin_fsdp2.trainer import FSDP2Trainer

    spec, engine, batch = rollouts(model_type)
    trainer = FSDP2Trainer(FSDP2Config(lr=1e-2, warmup_steps=0, grad_clip=1.0), spec=spec, tokenizer=tok,
                           seed=0, total_steps=10)
    trainer.load_weights(engine.model.state_dict().items())

    def nll(b, logprobs):
        loss = b.token_mean(-logprobs)
        return loss, {"nll": float(loss.detach())}

    losses = [trainer.train_step(batch, nll)["nll"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.1, losses


RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "arch"


@pytest.mark.parametrize("family", ["deepseek", "glm", "qwen3_next", "gpt_oss"])
def test_arch_recipe_short_run(family, tmp_path):
    """Each family's recipe end to end at a few steps: warm start, rollouts recording experts,
    a GRPO step replaying them; the warm start's loss falls (measured, seed 0, step 2 -> 4:
    deepseek 2.39 -> 2.13, glm 2.27 -> 2.17, qwen3_next 2.26 -> 1.93, gpt_oss 2.32 -> 2.22)."""
    from miles.cli import main

    out = tmp_path / "run"
    assert main(["train", str(RECIPES / f"{family}.yaml"), f"run.out_dir={out}", "loggers=[]", "run.steps=1",
                 "run.eval_every=1", "run.warm_start.max_steps=4", "run.warm_start.min_steps=4",
                 "run.warm_start.eval_every=2", "run.warm_start.batch_size=16",
                 "run.warm_start.trainer.warmup_steps=0", "rollout.batch_size=2", "rollout.n=2",
                 "env.eval_size=2", "algorithm.filter_zero_variance=false"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 1 and steps[0]["nonfinite_steps"] == 0
    assert steps[0]["train_rollout_logprob_abs_diff"] < 1e-3  # float32 engine, experts replayed
    warm = [json.loads(line)["sft_loss"] for line in (out / "warm_start.jsonl").read_text().splitlines()]
    assert len(warm) == 2 and warm[1] < warm[0], warm


# -- DeepSeek-V3's engine attention: decoding over the cached MLA latent ---------------------------
def _kv_b_calls(model):
    """Per ``kv_b_proj``, the token counts of its forwards (transformers' MLA runs it over the
    whole cache at every step; the absorbed decode reads its weight instead)."""
    calls = []
    for name, m in model.named_modules():
        if name.endswith("kv_b_proj"):
            m.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[-2]))
    return calls


@pytest.mark.parametrize("weights_dtype", ["model", "fp8"])
def test_deepseek_v3_engine_decodes_over_the_latent_cache(weights_dtype, tok):
    """Padded prompts of different lengths, 2 samples each: the decode steps never expand the
    cache, and the log-probs equal a plain transformers model's forward (for FP8 engine weights,
    the same quantized modules' forward), also after a weight sync."""
    from miles.protocols import OffersEngineAttention
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    spec = make_spec("deepseek_v3", replay=False)
    assert isinstance(spec.architecture(), OffersEngineAttention)
    # FP8 GEMMs (scaled_mm) would also round the latent to e4m3 before kv_b_proj, which the
    # absorbed form does not: the weight-only FP8 GEMM is the one both forms compute alike
    quant = {"fp8_gemm": "dequantized"} if weights_dtype == "fp8" else {}
    engine = TorchEngine(TorchEngineConfig(impl="hf", weights_dtype=weights_dtype, **quant), spec=spec,
                         tokenizer=tok, seed=0)
    if weights_dtype == "model":  # a transformers model of the engine's weights, its attention untouched
        reference = spec.build_model(tok).eval()
        assert type(reference.model.layers[0].self_attn).forward is reference.model.layers[0].self_attn.forward.__func__
    else:  # transformers' own attention over the same quantized modules: the engine's, cache-less
        reference = engine.model
    calls = _kv_b_calls(engine.model)
    for version, seed in ((1, 1), (2, 7)):
        weights = lively(engine.model if weights_dtype == "model" else spec.build_model(tok), seed)
        engine.load_weights(weights, version=version)
        if reference is not engine.model:
            reference.load_state_dict(dict(weights), strict=False)
        calls.clear()
        outs = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), n=2)
        cfg = engine.model.config
        # the prefill alone (no decode step expands the cache); a quantized kv_b_proj also derives its
        # weight once per layer and version
        derived = [cfg.kv_lora_rank] * cfg.num_hidden_layers if weights_dtype == "fp8" else []
        # the first call sizes the engine's cache rows from a 1-token forward
        probe = [1] * cfg.num_hidden_layers if version == 1 else []
        assert calls == probe + [max(len(p) for p in PROMPTS)] * cfg.num_hidden_layers + derived, calls
        assert max(len(c.token_ids) for cs in outs for c in cs) == 8  # decoded, not stopped at once
        worst = 0.0
        for prompt, comps in zip(PROMPTS, outs):
            for comp in comps:
                want = reference_logprobs(reference, prompt, comp.token_ids)
                worst = max(worst, (want - torch.tensor(comp.logprobs)).abs().max().item())
        assert worst < 1e-5, f"v{version}: engine log-probs differ from transformers' forward by {worst:.2e}"


def test_deepseek_v3_latent_cache_holds_the_latent_and_rope_key_and_survives_reorder_and_crop(tok):
    """Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim numbers; a row-repeated
    (n samples) and a cropped (rejected draft tokens) cache decode as a fresh one."""
    spec = make_spec("deepseek_v3", replay=False)
    engine = make_engine(spec, tok)
    cfg, model = engine.model.config, engine.model
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [2, 11, 12, 13, 14, 15]])
    mask = (torch.arange(6) >= torch.tensor([[3], [0]])).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        cache = engine._forward(ids, mask, pos).past_key_values
        for layer in cache.layers:
            assert tuple(layer.keys.shape) == (2, 1, 6, cfg.kv_lora_rank)
            assert tuple(layer.values.shape) == (2, 1, 6, cfg.qk_rope_head_dim)
        cache.reorder_cache(torch.tensor([0, 0, 1, 1]))  # two samples per prompt
        step = torch.tensor([[9], [10], [9], [10]])
        full_mask = torch.cat([mask.repeat_interleave(2, 0), torch.ones(4, 1, dtype=torch.long)], 1)
        got = engine._forward(step, full_mask, pos[:, -1:].repeat_interleave(2, 0) + 1, cache).logits[:, -1]
        assert cache.get_seq_length() == 7
        cache.crop(-1)  # drop the decoded token, decode it again
        again = engine._forward(step, full_mask, pos[:, -1:].repeat_interleave(2, 0) + 1, cache).logits[:, -1]
        reference = spec.build_model(tok).eval()
        reference.load_state_dict(model.state_dict())
        want = reference(input_ids=torch.cat([ids.repeat_interleave(2, 0), step], 1), attention_mask=full_mask,
                         position_ids=torch.cat([pos, pos[:, -1:] + 1], 1).repeat_interleave(2, 0),
                         use_cache=False).logits[:, -1]
    assert (got - want).abs().max() < 1e-5 and torch.equal(got, again)
    assert (got[0] - got[1]).abs().max() > 1e-3  # the two steps' tokens differ: rows were not mixed up


def test_deepseek_v3_routing_replay_records_through_the_latent_decode(rollouts):
    """The replay engine decodes with the absorbed attention, so the replay test above checks the
    experts recorded over it; here: every decode step was recorded, as many as tokens fed back."""
    spec, engine, batch = rollouts("deepseek_v3")
    attn = engine.model.model.layers[0].self_attn
    assert attn.forward.__func__ is not type(attn).forward
    assert len(spec.architecture().routers(engine.model)) == 1  # the MoE layer's router, still hooked
    for s in batch.samples:
        rec = s.extensions["moe"]["routed_experts"]
        assert rec.shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1 and (rec >= 0).all()
