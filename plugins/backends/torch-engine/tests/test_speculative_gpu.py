"""Speculative decoding on CUDA, the step replayed from CUDA graphs (``spec_graphs``): greedy
tokens are the plain path's, log-probs the target's, samples of the target's distribution
(``python -m pytest -m gpu plugins/backends/torch-engine/tests/test_speculative_gpu.py``)."""
from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from miles import SamplingParams
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine
from spec_checks import empirical, exact, tv, tv_bound

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class _Spec:
    def __init__(self, model):
        self.model = model

    def build_model(self, tokenizer):
        return copy.deepcopy(self.model)


class _Tok:
    eos_token_id, pad_token_id = None, 0


def _model(seed: int, vocab: int, hidden: int = 64, layers: int = 2) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharp distributions: rejections matter, greedy has no near-ties
        model.lm_head.weight.mul_(4.0)
    return model


def _engine(model, speculative=None, **kw) -> TorchEngine:
    cfg = TorchEngineConfig.model_validate({"device": "cuda", **kw,
                                            **({"speculative": speculative} if speculative else {})})
    return TorchEngine(cfg, spec=_Spec(model), tokenizer=_Tok(), seed=1)


@pytest.fixture(scope="module")
def target():
    return _model(0, vocab=97)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft")
    _model(7, vocab=97, hidden=32).save_pretrained(path)
    return str(path)


def _draft(kind: str, path: str, k: int = 3) -> dict:
    extra = {"model_path": path} if kind == "model" else {}
    return {"draft": kind, "tokens": k, "max_batch": 1 << 20, **extra}


def _target_logprobs(model, prompt, tokens) -> list[float]:
    """The target's ``log_softmax(logits)`` at each token of the completion (its own forward)."""
    ids = torch.tensor([list(prompt) + list(tokens)], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1).tolist()


@pytest.mark.parametrize("draft", ["head", "model"])
@pytest.mark.parametrize("batch", [1, 8])
def test_graphed_greedy_is_plain_greedy_and_logprobs_are_the_targets(target, draft_dir, draft, batch):
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(1, 97, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(batch)]
    params = SamplingParams(0.0, 1.0, 0, 40, [5])  # rows stop at different steps
    plain = _engine(target).generate(prompts, params)
    spec_engine = _engine(target, _draft(draft, draft_dir))
    spec = spec_engine.generate(prompts, params)
    graphs = spec_engine._spec.graphs
    assert graphs.use_graphs and graphs._graphs, "the speculative step did not run from CUDA graphs"
    for p, a, b in zip(prompts, itertools.chain(*plain), itertools.chain(*spec)):
        assert a.token_ids == b.token_ids
        assert b.finish_reason == a.finish_reason
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert np.allclose(b.logprobs, _target_logprobs(spec_engine.model, p, b.token_ids), atol=1e-4)
    m = spec_engine.step_metrics()
    assert 1.0 <= m["spec_accept_len"] <= 4.0
    # graphs off: the same step eagerly, the same tokens
    eager = _engine(target, _draft(draft, draft_dir), cuda_graphs=False).generate(prompts, params)
    assert [c.token_ids for c in itertools.chain(*eager)] == [c.token_ids for c in itertools.chain(*spec)]


@pytest.mark.parametrize("batch", [1, 8])
def test_graphed_sampling_logprobs_are_the_targets_at_temperature_one(target, draft_dir, batch):
    """Sampled at temperature 1 (uniforms drawn outside the graph): every returned log-prob is the
    target's own ``log_softmax`` at that token, and the drafts are both accepted and rejected."""
    prompts = [[1 + i, 2, 3 + i] for i in range(batch)]
    spec_engine = _engine(target, _draft("head", draft_dir))
    params = SamplingParams(1.0, 1.0, 0, 24, [], seed=11)
    out = spec_engine.generate(prompts, params, n=2)
    assert spec_engine._spec.graphs._graphs
    for p, comps in zip(prompts, out):
        for c in comps:
            assert len(c.token_ids) == 24
            assert np.allclose(c.logprobs, _target_logprobs(spec_engine.model, p, c.token_ids), atol=1e-4)
    again = spec_engine.generate(prompts, params, n=2)  # a seeded request replays the same draws
    assert [c.token_ids for c in itertools.chain(*again)] == [c.token_ids for c in itertools.chain(*out)]
    m = spec_engine.step_metrics()
    assert 0.0 < m["spec_accept_rate"] < 1.0


PROMPT, STEPS, VOCAB = [1, 2, 3], 3, 6


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_graphed_samples_have_exactly_the_targets_distribution(temperature, top_k, top_p):
    """The CPU test's total-variation check of all 216 three-token continuations, on the graphs."""
    cpu_model = _model(0, vocab=VOCAB, hidden=32)
    N = 6000
    params = SamplingParams(temperature, top_p, top_k, STEPS, [], seed=3)
    probs = exact(cpu_model, PROMPT, STEPS, VOCAB, params)
    keys, p = list(probs), np.array(list(probs.values()))
    spec_engine = _engine(cpu_model, {"draft": "head", "tokens": 2, "max_batch": 1 << 20})
    spec = empirical(spec_engine.generate([PROMPT], params, n=N)[0], keys)
    assert spec_engine._spec.graphs._graphs
    assert tv(spec, p) < tv_bound(p, N)
    m = spec_engine.step_metrics()
    assert 0.0 < m["spec_accept_rate"] < 1.0
