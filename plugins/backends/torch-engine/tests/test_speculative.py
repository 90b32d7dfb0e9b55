"""Speculative decoding (engine.speculative): exact target sampling, the target's log-probs,
continuous batching, drafts that follow weight syncs, and config errors."""
from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from miles import ConfigError, SamplingParams
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine
from spec_checks import empirical, exact, tv, tv_bound

VOCAB, STEPS, PROMPT = 6, 3, [1, 2, 3]
pytestmark = pytest.mark.usefixtures("single_thread")


class _Spec:
    def __init__(self, model):
        self.model = model

    def build_model(self, tokenizer):
        return copy.deepcopy(self.model)


class _Tok:
    eos_token_id, pad_token_id = None, 0


def _model(seed: int, vocab: int = VOCAB, hidden: int = 32) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper distributions than the default init: rejections matter
        model.lm_head.weight.mul_(4.0)
    return model


def _engine(model, speculative=None, **kw) -> TorchEngine:
    cfg = TorchEngineConfig.model_validate({**kw, **({"speculative": speculative} if speculative else {})})
    return TorchEngine(cfg, spec=_Spec(model), tokenizer=_Tok(), seed=1)


@pytest.fixture(scope="module")
def target():
    return _model(0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A different small model with the same vocabulary: partial acceptance."""
    path = tmp_path_factory.mktemp("draft")
    _model(7, hidden=16).save_pretrained(path)
    return str(path)


DRAFTS = {"head": lambda d: {"draft": "head", "tokens": 2, "max_batch": 1 << 20},
          "model": lambda d: {"draft": "model", "model_path": d, "tokens": 3, "max_batch": 1 << 20}}


@pytest.mark.parametrize("draft,sync_every", [("head", 1), ("model", 1), ("head", 3)])
def test_greedy_tokens_are_the_targets_and_logprobs_too(target, draft_dir, draft, sync_every):
    prompts = [[1, 2, 3], [4, 5], [3, 1, 4, 1, 5], [2], [0, 4], [3, 3, 3]]
    params = SamplingParams(0.0, 1.0, 0, 9, [5])  # rows stop at different steps
    plain = _engine(target).generate(prompts, params, n=2)
    # 4 cache rows for 8 samples: groups join as rows free up (continuous batching)
    spec_engine = _engine(target, DRAFTS[draft](draft_dir), max_batch_size=4)
    # as on CUDA: finished rows are seen every few steps and emit nothing meanwhile
    spec_engine._spec.sync_every = sync_every
    spec = spec_engine.generate(prompts, params, n=2)
    for a, b in zip(itertools.chain(*plain), itertools.chain(*spec)):
        assert a.token_ids == b.token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert b.finish_reason == a.finish_reason
    m = spec_engine.step_metrics()
    assert 1.0 <= m["spec_accept_len"] <= 1 + DRAFTS[draft](draft_dir)["tokens"]
    assert spec_engine._spec.stats["joined_mid_decode"] > 0
    assert spec_engine.step_metrics() == {}  # drained


class _Replayed:
    """A CUDA graph's stand-in on CPU: a replay runs the captured step again, eagerly."""

    def __init__(self, run, device, pool, after_warmup=None):
        run()  # the warm-up, as capture_graph runs it, then undone
        if after_warmup is not None:
            after_warmup()
        self.replay = run


def test_the_graphed_step_path_on_cpu_gives_the_eager_outputs_and_counts(target, monkeypatch):
    """The CUDA-graph path of the speculative step (``spec_graphs``) with each graph's replay run
    eagerly: a bucket steps the free rows past the live ones too, the capture's warm-up advances
    the rows once and is undone, the attention length comes from the host-side bound, and the
    host reads the rows' flags every few steps. Outputs are the target's greedy ones and every
    completion's acceptance counts are the eager path's."""
    from miles_plugin_torch_engine import spec_graphs
    from miles_plugin_torch_engine.cuda_graphs import DecodeRunner

    # 7 rows through 4 cache rows: rows join mid-decode, and 3 live rows step a bucket of 4 (a
    # free row, one that stopped early, with them)
    prompts = [[1, 2, 3], [4, 5], [3, 1, 4, 1, 5], [2], [0, 4], [3, 3, 3], [1, 1]]
    params = SamplingParams(0.0, 1.0, 0, 16, [5])
    plain = _engine(target).generate(prompts, params, n=1)
    engines = [_engine(target, DRAFTS["head"](None), max_batch_size=4) for _ in range(2)]
    want = engines[0].generate(prompts, params, n=1)
    monkeypatch.setattr(spec_graphs, "capture_graph", _Replayed)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(DecodeRunner, "LENGTH_STEP", 1)  # the head attends exactly up to the bound
    graphed = engines[1]._spec
    graphed.graphs.use_graphs, graphed.sync_every = True, 2
    got = engines[1].generate(prompts, params, n=1)
    assert graphed.graphs._graphs  # the graphed path ran
    for a, b in zip(itertools.chain(*plain), itertools.chain(*got)):
        assert a.token_ids == b.token_ids and np.allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert [c.extras for c in itertools.chain(*got)] == [c.extras for c in itertools.chain(*want)]
    assert engines[1].step_metrics() == engines[0].step_metrics()


def _exact(model, params: SamplingParams) -> dict[tuple, float]:
    return exact(model, PROMPT, STEPS, VOCAB, params)


@pytest.mark.parametrize("draft", sorted(DRAFTS))
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_samples_have_exactly_the_targets_distribution(target, draft_dir, draft, temperature, top_k, top_p):
    """Total-variation distance between speculative and plain samples of all 216 continuations
    stays within what two independent samples of the exact distribution show (99.9th percentile
    of 300 simulated pairs), while the draft's own distribution is far from it."""
    N = 6000
    params = SamplingParams(temperature, top_p, top_k, STEPS, [], seed=3)
    exact = _exact(target, params)
    keys, p = list(exact), np.array(list(exact.values()))
    spec_engine = _engine(target, DRAFTS[draft](draft_dir))
    spec = empirical(spec_engine.generate([PROMPT], params, n=N)[0], keys)
    plain = empirical(_engine(target).generate([PROMPT], params, n=N)[0], keys)
    bound = tv_bound(p, N)
    assert tv(spec, plain) < bound
    assert tv(spec, p) < bound
    m = spec_engine.step_metrics()
    assert 0.0 < m["spec_accept_rate"] < 1.0  # drafts were both accepted and rejected


def test_a_biased_verifier_fails_the_same_check(target, monkeypatch):
    """The check above has power: accepting every draft (sampling the draft's distribution)
    lands far outside the bound."""
    from miles_plugin_torch_engine import speculative

    verify = speculative.verify

    def accept_all(p, q, drafts, gen, u=None):
        out, _ = verify(p, q, drafts, gen, u)
        out[:, :-1] = drafts
        return out, torch.full((drafts.shape[0],), drafts.shape[1], device=drafts.device)

    N, params = 6000, SamplingParams(1.0, 1.0, 0, STEPS, [], seed=3)
    exact = _exact(target, params)
    keys, p = list(exact), np.array(list(exact.values()))
    monkeypatch.setattr(speculative, "verify", accept_all)
    biased = empirical(_engine(target, DRAFTS["head"](None)).generate([PROMPT], params, n=N)[0], keys)
    assert tv(biased, p) > 0.2


@pytest.mark.parametrize("speculative,match", [
    ({"draft": "mtp", "path": "x"}, "MTP layers"),
    ({"draft": "model"}, "model_path"),
    ({"draft": "head", "tokens": 0}, "tokens"),
    ({"draft": "head", "max_batch": 0}, "max_batch"),
    ({"draft": "head", "min_accept_len": 0.5}, "min_accept_len"),
])
def test_config_errors_name_the_key(speculative, match):
    from miles.config import validate_settings

    problems: list[str] = []
    validate_settings(TorchEngineConfig, "engine", {"speculative": speculative}, problems)
    assert problems and match in " ".join(problems) and problems[0].startswith("engine.speculative")


def test_the_models_own_forward_refuses_speculation(target):
    with pytest.raises(ConfigError, match="fast path"):
        _engine(target, {"draft": "head"}, impl="hf")


def test_above_max_batch_the_plain_path_runs_and_weights_reach_the_head(target):
    engine = _engine(target, {"draft": "head", "tokens": 2, "max_batch": 4})
    params = SamplingParams(0.0, 1.0, 0, 5, [])
    engine.generate([[1, 2]], params, n=5)  # 5 rows > 4
    assert engine.step_metrics() == {}
    engine.generate([[1, 2]], params, n=4)
    assert "spec_accept_len" in engine.step_metrics()
    head = engine._spec.drafter.head
    new = torch.full_like(head.fc.weight, 0.5)
    engine.load_weights([("draft_head.fc.weight", new)], version=3)
    assert torch.equal(head.fc.weight, new)


def test_auto_drafts_at_no_batch_size_on_cpu_and_says_how_to_force_it(target, caplog):
    engine = _engine(target, {"draft": "head", "tokens": 2})
    assert "set engine.speculative.max_batch to draft anyway" in caplog.text
    engine.generate([[1, 2]], SamplingParams(0.0, 1.0, 0, 5, []), n=1)
    assert engine.step_metrics() == {}


def test_below_min_accept_len_calls_decode_plain_and_every_8th_measures_again(target):
    # k = 2 gains at most 3 tokens a step: a floor of 3.5 is never met, 1.0 always is
    params, drafted = SamplingParams(1.0, 1.0, 0, 5, [], seed=0), {}
    for floor in (3.5, 1.0):
        engine = _engine(target, {"draft": "head", "tokens": 2, "max_batch": 64, "min_accept_len": floor})
        drafted[floor] = []
        for call in range(17):
            engine.generate([[1, 2]], params, n=2)
            if "spec_accept_len" in engine.step_metrics():
                drafted[floor].append(call)
    assert drafted[3.5] == [0, 8, 16]
    assert drafted[1.0] == list(range(17))


def test_min_accept_len_auto_gates_only_cuda_with_max_batch_auto():
    from miles_plugin_torch_engine.config import SpeculativeConfig
    from miles_plugin_torch_engine.speculative import AcceptanceGate

    def floor(device: str, **kw) -> float | None:
        return AcceptanceGate.for_config(SpeculativeConfig(draft="head", **kw), torch.device(device)).floor

    assert floor("cuda") == 2.0 and floor("cpu") is None
    assert floor("cuda", max_batch=64) is None and floor("cuda", min_accept_len=None) is None
    assert floor("cpu", min_accept_len=1.5) == 1.5


def test_miles_serve_app_generates_through_the_speculative_engine():
    """``/generate`` of ``miles serve``'s app on a speculative engine: the plain engine's greedy
    tokens and log-probs, the acceptance counted."""
    import asyncio

    import httpx
    from miles.testing import TinySpec, char_tokenizer

    from miles_plugin_torch_engine.scheduler import Scheduler
    from miles_plugin_torch_engine.server import build_app

    tok = char_tokenizer()
    cfg = TorchEngineConfig.model_validate({"speculative": {"draft": "head", "tokens": 2, "max_batch": 8}})
    spec = TorchEngine(cfg, spec=TinySpec(), tokenizer=tok, seed=0)
    plain = TorchEngine(TorchEngineConfig(), spec=TinySpec(), tokenizer=tok, seed=0)
    scheduler = Scheduler(spec)
    app = build_app(spec, scheduler, model_dir="mem")
    body = {"input_ids": [2, 5, 6], "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            "return_logprob": True}

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/generate", json=body)

    try:
        r = asyncio.run(post())
    finally:
        scheduler.stop()
    assert r.status_code == 200, r.text
    want = plain.generate([[2, 5, 6]], SamplingParams(0.0, 1.0, 0, 8, [tok.eos_token_id]))[0][0]
    assert r.json()["output_ids"] == want.token_ids
    assert "spec_accept_len" in spec.step_metrics()
