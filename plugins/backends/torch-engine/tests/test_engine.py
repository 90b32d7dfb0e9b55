import warnings

import pytest
import torch
from miles import SamplingParams
from miles.testing import TinySpec, char_tokenizer

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine
from miles.testing import assert_lazy_registration

PROMPTS = [[2, 5, 6, 7, 8, 9, 10], [2, 11], [2, 12, 13, 14], [2, 15, 16, 17, 18]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matmuls gain nothing from threads, and OpenMP spin-waits make them ~1000x slower when
    # another process holds a core
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def lively_weights(model, seed):
    """Random weights with large layer outputs: TinySpec's default init (std 0.02, tied embeddings)
    makes greedy decoding just repeat the last token, which would make the greedy tests vacuous."""
    g = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5 * (1 if "embed" in name else 3))
            for name, p in model.named_parameters() if p.dim() == 2]


def make_engine(tok, seed=0, weights_seed=0, **cfg):
    eng = TorchEngine(TorchEngineConfig(**cfg), spec=TinySpec(), tokenizer=tok, seed=seed)
    eng.load_weights(lively_weights(eng.model, weights_seed), version=1)
    return eng


def full_logprobs(model, prompt, response, temperature=1.0):
    """Reference: one unpadded forward over prompt+response, no cache."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def greedy_reference(model, prompt, steps, stop):
    """Reference greedy decode that re-runs the whole sequence every step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(nxt)
            if nxt in stop:
                break
    return seq[len(prompt):]


def tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (0.7, 0.9, 5)])
def test_logprobs_match_full_forward(tok, temperature, top_p, top_k):
    eng = make_engine(tok)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=6, seed=1)
    groups = eng.generate(PROMPTS, params, n=3)
    for prompt, group in zip(PROMPTS, groups):
        assert len(group) == 3
        for c in group:
            ref = full_logprobs(eng.model, prompt, c.token_ids, temperature)
            assert len(c.logprobs) == len(c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)
    # the scoring helper agrees with the same reference (temperature 1)
    flat = [(p, c.token_ids) for p, g in zip(PROMPTS, groups) for c in g]
    scored = eng.logprobs([p for p, _ in flat], [r for _, r in flat])
    for (p, r), lp in zip(flat, scored):
        torch.testing.assert_close(torch.tensor(lp), full_logprobs(eng.model, p, r), atol=1e-5, rtol=0)


def test_greedy_matches_uncached_reference(tok):
    eng = make_engine(tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    groups = eng.generate(PROMPTS, params, n=2)
    for prompt, group in zip(PROMPTS, groups):
        ref = greedy_reference(eng.model, prompt, 8, {tok.eos_token_id})
        assert [c.token_ids for c in group] == [ref, ref]
        torch.testing.assert_close(torch.tensor(group[0].logprobs), full_logprobs(eng.model, prompt, ref),
                                   atol=1e-5, rtol=0)


def test_top_k_one_is_greedy_and_seeds_reproduce(tok):
    eng = make_engine(tok)
    greedy = tokens(eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6), n=2))
    top1 = tokens(eng.generate(PROMPTS, SamplingParams(top_k=1, max_new_tokens=6, seed=3), n=2))
    assert top1 == greedy
    sample = lambda e, seed: tokens(e.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=seed), n=4))  # noqa: E731
    assert sample(eng, 7) == sample(eng, 7)
    assert sample(eng, 7) != sample(eng, 8)
    # without a request seed, the engine's own seed makes runs reproducible
    unseeded = lambda e: tokens(e.generate(PROMPTS, SamplingParams(max_new_tokens=6), n=4))  # noqa: E731
    assert unseeded(make_engine(tok, seed=5)) == unseeded(make_engine(tok, seed=5))
    assert unseeded(make_engine(tok, seed=5)) != unseeded(make_engine(tok, seed=6))


def test_stop_tokens_and_lengths(tok):
    eng = make_engine(tok)
    free = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
    stop_id = free[0][0].token_ids[2]
    stop = {stop_id, tok.eos_token_id}
    params = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[stop_id])
    groups = eng.generate(PROMPTS, params, n=3)
    assert len(groups) == len(PROMPTS) and all(len(g) == 3 for g in groups)
    for prompt, g in zip(PROMPTS, groups):
        expect = greedy_reference(eng.model, prompt, 6, stop)
        for c in g:
            assert c.token_ids == expect and len(c.logprobs) == len(c.token_ids)
            if c.token_ids[-1] in stop:
                assert c.finish_reason == "stop"
                assert not stop & set(c.token_ids[:-1])
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 6
    first = groups[0][0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == stop_id and len(first.token_ids) <= 3
    sampled = eng.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=0), n=5)
    assert sum(len(g) for g in sampled) == len(PROMPTS) * 5
    for c in (c for g in sampled for c in g):
        assert (c.finish_reason == "length") == (len(c.token_ids) == 5 and c.token_ids[-1] != tok.eos_token_id)


def test_chunking_preserves_results(tok):
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    whole = tokens(make_engine(tok).generate(PROMPTS, params, n=3))
    assert tokens(make_engine(tok, max_batch_size=4).generate(PROMPTS, params, n=3)) == whole
    assert tokens(make_engine(tok, max_batch_size=2).generate(PROMPTS, params, n=3)) == whole
    assert make_engine(tok).generate(PROMPTS, SamplingParams(max_new_tokens=0), n=2)[0][0].token_ids == []


def test_load_weights(tok):
    eng = make_engine(tok)
    other = TinySpec(seed=1).build_model(tok).eval()
    other.load_state_dict(dict(lively_weights(other, seed=1)), strict=False)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = tokens(eng.generate(PROMPTS, params))
    eng.load_weights(other.state_dict().items(), version=7)
    assert eng.weight_version == 7
    after = eng.generate(PROMPTS, params)
    assert tokens(after) != before
    assert tokens(after) == tokens(make_engine(tok, weights_seed=1).generate(PROMPTS, params))
    assert all(c.weight_version == 7 for g in after for c in g)
    c = after[1][0]
    torch.testing.assert_close(torch.tensor(c.logprobs), full_logprobs(other, PROMPTS[1], c.token_ids),
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="model.not_a_weight"):
        eng.load_weights([("model.not_a_weight", torch.zeros(1))], version=8)


def test_decode_is_kv_cached(tok):
    eng = make_engine(tok, impl="hf")  # the model's own forward (the CPU default is the fast path)
    steps, n = 5, 3
    params = SamplingParams(temperature=0.0, max_new_tokens=steps)
    eng.generate(PROMPTS, params, n=n)  # the first call sizes the cache rows (one 1-token probe forward)
    shapes = []
    forward = eng.model.forward

    def counting(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    eng.model.forward = counting
    groups = eng.generate(PROMPTS, params, n=n)
    assert all(c.finish_reason == "length" for g in groups for c in g)  # precondition: no early stop
    assert len(shapes) == 1 + (steps - 1)
    assert shapes[0] == (len(PROMPTS), max(map(len, PROMPTS)))  # each prompt prefilled once
    assert all(s == (len(PROMPTS) * n, 1) for s in shapes[1:])


def test_no_warnings_and_lazy_registration(tok):
    eng = make_engine(tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0), n=2)
    assert_lazy_registration("miles_plugin_torch_engine", "engines", "torch")


@pytest.mark.parametrize("top_k,top_p,allowed", [(0, 1.0, 5), (2, 1.0, 2), (0, 0.7, 3), (0, 0.6, 2)])
def test_sampler_distribution(top_k, top_p, allowed):
    from miles_plugin_torch_engine.engine import _sample

    probs = torch.tensor([0.4, 0.25, 0.15, 0.12, 0.08])
    logits = probs.log().expand(40000, -1)
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    tok, lp = _sample(logits, params, torch.Generator().manual_seed(0))
    torch.testing.assert_close(lp, probs.log()[tok])  # unfiltered log-probs
    want = torch.zeros(5)
    want[:allowed] = probs[:allowed] / probs[:allowed].sum()
    freq = torch.bincount(tok, minlength=5).float() / len(tok)
    torch.testing.assert_close(freq, want, atol=0.01, rtol=0)


class TripAfter:
    """An ``interrupt`` event that reads as set from its ``k + 1``-th check on: a deterministic
    abort in the middle of a generation (the server sets the real one from another thread)."""

    def __init__(self, k: int):
        self.k = k

    def is_set(self) -> bool:
        self.k -= 1
        return self.k < 0


@pytest.mark.parametrize("impl", ["hf", "fast"])
def test_interrupt_returns_partial_samples_that_resume_where_they_stopped(tok, impl):
    eng = make_engine(tok, impl=impl)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    full = eng.generate(PROMPTS, params, n=2)
    eng.interrupt = TripAfter(4)
    cut = eng.generate(PROMPTS, params, n=2)
    aborted = 0
    for prompt, whole, part in zip(PROMPTS, full, cut):
        for w, c in zip(whole, part):
            if c.finish_reason != "abort":  # finished before the interrupt
                assert (c.token_ids, c.finish_reason) == (w.token_ids, w.finish_reason)
                continue
            aborted += 1
            k = len(c.token_ids)
            assert 0 < k < len(w.token_ids) and c.token_ids == w.token_ids[:k]
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(w.logprobs[:k]), atol=1e-5, rtol=0)
            # resumed from prompt + its tokens with the tokens left: the rest of the same sample
            eng.interrupt = TripAfter(1 << 30)
            rest = eng.generate([prompt + c.token_ids], SamplingParams(temperature=0.0, max_new_tokens=12 - k))[0][0]
            assert (rest.token_ids, rest.finish_reason) == (w.token_ids[k:], w.finish_reason)
            torch.testing.assert_close(torch.tensor(rest.logprobs), torch.tensor(w.logprobs[k:]), atol=1e-4, rtol=0)
    assert aborted > 0
    eng.interrupt = TripAfter(0)  # already set when generate starts: nothing runs
    assert {(len(c.token_ids), c.finish_reason) for g in eng.generate(PROMPTS, params) for c in g} == {(0, "abort")}
