"""Speculative decoding with the model's own MTP layer (engine.speculative draft mtp, on the
model's own forward): greedy tokens and log-probs are the target's, samples have exactly the
target's distribution, acceptance is reported, and models it cannot serve are refused."""
from __future__ import annotations

import copy
import functools
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from miles import ConfigError, SamplingParams, make_plugin_manager
from spec_checks import empirical, exact, tv, tv_bound

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine

VOCAB, STEPS, PROMPT = 6, 3, [1, 2, 3]
pytestmark = pytest.mark.usefixtures("single_thread")
CONFIGS = {  # tests/test_mtp.py's tiny shapes, with a vocabulary small enough to enumerate
    "deepseek_v3": {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
                    "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                    "n_routed_experts": 4, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
                    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 8},
    "glm4_moe": {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
                 "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                 "n_routed_experts": 4, "num_experts_per_tok": 2},
}


class _Spec:
    """The model (its MTP layer attached) and its architecture, as the hf spec gives them."""

    def __init__(self, model, arch):
        self.model, self.arch = model, arch

    def architecture(self):
        return self.arch

    def build_model(self, tokenizer):
        return copy.deepcopy(self.model)


class _Tok:
    eos_token_id, pad_token_id = None, 0


@functools.cache  # engines deep-copy the model: one build per family serves every test
def _spec(family: str, vocab: int = VOCAB) -> _Spec:
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = make_plugin_manager().create("architectures", family, None)
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=vocab, num_nextn_predict_layers=1, max_position_embeddings=256,
                                  pad_token_id=0, **CONFIGS[family])
    model = AutoModelForCausalLM.from_config(config).eval()
    (layer,) = arch.attach_mtp(model, None)
    with torch.no_grad():  # sharper distributions than the default init: rejections matter
        model.lm_head.weight.mul_(4.0)
    _fit(model, layer)
    return _Spec(model, arch)


def _fit(model, layer, steps: int = 100) -> list[float]:
    """Steps of ``mtp_loss`` on the model's own samples and greedy continuations, so that drafts
    are often but not always the model's tokens; the losses."""
    from miles_mtp import mtp_loss

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (96, 3), generator=gen)
    with torch.no_grad():
        for _ in range(7):
            logits = model(ids).logits[:, -1]
            drawn = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            ids = torch.cat([ids, torch.cat([drawn[:64], logits[64:].argmax(-1, keepdim=True)])], 1)
        hidden = model.model(ids).last_hidden_state
    valid, pos = torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids)
    weights = torch.ones(ids.shape[0], ids.shape[1] - 2)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss, _ = mtp_loss(layer, hidden, ids, valid, pos, model.model.rotary_emb, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    layer.zero_grad(set_to_none=True)
    return losses


def _engine(spec, speculative=None, **kw) -> TorchEngine:
    cfg = TorchEngineConfig.model_validate({**kw, **({"speculative": speculative} if speculative else {})})
    return TorchEngine(cfg, spec=spec, tokenizer=_Tok(), seed=1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family_spec(request):
    return _spec(request.param)


MTP = {"draft": "mtp", "tokens": 3, "max_batch": 1 << 20}


def test_greedy_tokens_are_the_targets_and_logprobs_too(family_spec):
    prompts = [[1, 2, 3], [4, 5], [3, 1, 4, 1, 5], [2], [0, 4], [3, 3, 3]]
    params = SamplingParams(0.0, 1.0, 0, 9, [5])  # rows stop at different steps
    plain = _engine(family_spec).generate(prompts, params, n=2)
    engine = _engine(family_spec, MTP)
    spec = engine.generate(prompts, params, n=2)
    for a, b in zip(itertools.chain(*plain), itertools.chain(*spec)):
        assert a.token_ids == b.token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert b.finish_reason == a.finish_reason
    m = engine.step_metrics()
    # drafts both accepted and rejected: rows of one batch kept different positions
    assert 0.0 < m["spec_accept_rate"] < 1.0
    assert 1.0 < m["spec_accept_len"] < 1 + MTP["tokens"]
    assert engine.engine_stats()[0]["spec_accept_rate"] > 0.0
    assert engine.step_metrics() == {}  # drained
    one = _engine(family_spec, MTP).generate([prompts[2]], params, n=1)[0][0]  # a row alone: crops, no holes
    assert one.token_ids == plain[2][0].token_ids


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_samples_have_exactly_the_targets_distribution(temperature, top_k, top_p):
    """Total-variation distance between speculative and plain samples of all 216 continuations
    stays within what two independent samples of the exact distribution show."""
    spec, N = _spec("deepseek_v3"), 6000
    params = SamplingParams(temperature, top_p, top_k, STEPS, [], seed=3)
    probs = exact(spec.model, PROMPT, STEPS, VOCAB, params)
    keys, p = list(probs), np.array(list(probs.values()))
    engine = _engine(spec, {**MTP, "tokens": 2}, max_batch_size=N)
    drafted = empirical(engine.generate([PROMPT], params, n=N)[0], keys)
    plain = empirical(_engine(spec, max_batch_size=N).generate([PROMPT], params, n=N)[0], keys)
    bound = tv_bound(p, N)
    assert tv(drafted, plain) < bound
    assert tv(drafted, p) < bound
    m = engine.step_metrics()
    assert 0.0 < m["spec_accept_rate"] < 1.0


def test_above_max_batch_the_models_own_decoding_runs_and_weights_reach_the_mtp_layer(family_spec):
    engine = _engine(family_spec, {**MTP, "max_batch": 4})
    params = SamplingParams(0.0, 1.0, 0, 5, [])
    engine.generate([[1, 2]], params, n=5)  # 5 rows > 4
    assert engine.step_metrics() == {}
    engine.generate([[1, 2]], params, n=4)
    assert "spec_accept_len" in engine.step_metrics()
    name = f"model.layers.{engine.model.config.num_hidden_layers}.eh_proj.weight"  # the checkpoint's name
    new = torch.full_like(dict(engine.model.named_parameters())[name], 0.5)
    engine.load_weights([(name, new)], version=3)
    assert torch.equal(engine._mtp.layer.eh_proj.weight, new)


def test_below_min_accept_len_mtp_calls_decode_plain_and_every_8th_measures_again():
    engine = _engine(_spec("deepseek_v3"), {**MTP, "min_accept_len": 4.5})  # k = 3 gains at most 4
    drafted = []
    for call in range(9):
        engine.generate([[1, 2]], SamplingParams(1.0, 1.0, 0, 4, [], seed=0), n=2)
        if "spec_accept_len" in engine.step_metrics():
            drafted.append(call)
    assert drafted == [0, 8]


def test_a_model_without_mtp_layers_is_refused():
    from miles.testing import TinySpec, char_tokenizer

    mtp = TorchEngineConfig.model_validate({"speculative": {"draft": "mtp"}})
    with pytest.raises(ConfigError, match="engine.speculative.draft.*does not attach"):
        TorchEngine(mtp, spec=TinySpec(), tokenizer=char_tokenizer())
    qwen = SimpleNamespace(architecture=lambda: None, build_model=TinySpec().build_model)  # no plugin: no MTP
    with pytest.raises(ConfigError, match="engine.speculative.draft.*qwen2 carries none"):
        TorchEngine(mtp, spec=qwen, tokenizer=char_tokenizer())


def test_caches_that_cannot_roll_back_are_refused():
    """Sliding-window layers are refused, naming why; gated-DeltaNet layers roll back per row
    (test_speculative_mtp_linear.py)."""
    from transformers import AutoConfig

    from miles_plugin_torch_engine.hf_speculative import _rollback_problem

    small = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 8}
    sliding = AutoConfig.for_model("gpt_oss", num_hidden_layers=2, **small)
    problem = _rollback_problem(SimpleNamespace(config=sliding))
    assert "DynamicSlidingWindowLayer" in problem and "window counts cache slots" in problem
    recurrent = AutoConfig.for_model("qwen3_next", num_hidden_layers=4, **small)  # gated DeltaNet layers
    assert _rollback_problem(SimpleNamespace(config=recurrent)) is None
    mla = AutoConfig.for_model("deepseek_v3", vocab_size=8, **CONFIGS["deepseek_v3"])
    assert _rollback_problem(SimpleNamespace(config=mla)) is None


def test_miles_serve_drafts_with_the_mtp_layer_of_its_folder(tmp_path):
    """``miles serve FOLDER engine.speculative.draft=mtp``: the folder spec attaches the MTP layer
    the folder stores (transformers drops it); ``/generate``'s greedy answer is the plain engine's,
    and ``/metrics`` reports the drafts' acceptance."""
    import asyncio

    import httpx
    from miles.testing import char_tokenizer

    from miles_plugin_torch_engine.scheduler import Scheduler
    from miles_plugin_torch_engine.server import FolderSpec, build_app, served_spec

    tok = char_tokenizer("abc")  # VOCAB tokens: the cached model's
    src = _spec("deepseek_v3")
    folder = str(tmp_path / "model")
    src.model.save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = TorchEngineConfig.model_validate({"speculative": MTP})
    spec = served_spec(folder, cfg)
    engine = TorchEngine(cfg, spec=spec, tokenizer=spec.build_tokenizer(), seed=0)
    name = "model.layers.2.eh_proj.weight"  # read from the folder, not initialised
    assert torch.equal(dict(engine.model.named_parameters())[name], dict(src.model.named_parameters())[name])
    scheduler = Scheduler(engine)
    app = build_app(engine, scheduler, model_dir=folder)
    body = {"input_ids": [[2, 3, 4], [2, 5]], "sampling_params": {"temperature": 0, "max_new_tokens": 10},
            "return_routed_experts": True}

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/generate", json=body), await c.get("/metrics")

    try:
        r, metrics = asyncio.run(ask())
    finally:
        scheduler.stop()
    assert r.status_code == 200, r.text
    plain = TorchEngine(TorchEngineConfig(), spec=FolderSpec(folder), tokenizer=tok, seed=0)
    want = plain.generate(body["input_ids"], SamplingParams(0.0, 1.0, 0, 10, [tok.eos_token_id]))
    assert [o["output_ids"] for o in r.json()] == [c[0].token_ids for c in want]
    for o, p in zip(r.json(), body["input_ids"]):  # the kept positions' routes: prompt + response - 1 rows
        shape = o["meta_info"]["routed_experts_shape"]
        assert shape[0] == len(p) + len(o["output_ids"]) - 1 and len(shape) == 3, shape
    rate = [line for line in metrics.text.splitlines() if line.startswith("miles_engine_spec_accept_rate")]
    assert rate and 0.0 < float(rate[0].split()[-1]) <= 1.0, metrics.text[-2000:]
