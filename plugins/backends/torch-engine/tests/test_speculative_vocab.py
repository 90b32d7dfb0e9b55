"""A reduced draft vocabulary (the head's ``draft_vocab``, EAGLE-3): the head drafts only the
subset's tokens, greedy outputs stay the target's, samples keep the target's distribution, and the
subset and its LM head rows follow weight syncs."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from miles import SamplingParams

from spec_checks import empirical, exact, tv, tv_bound
from test_speculative import PROMPT, STEPS, VOCAB, _engine, _model, _Replayed

pytestmark = pytest.mark.usefixtures("single_thread")
HEAD = {"draft": "head", "tokens": 2, "max_batch": 1 << 20}
SUBSET = [1, 3, 4]


@pytest.fixture(scope="module")
def target():
    return _model(0)


def _subset(ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """A ``draft_vocab`` buffer: the subset's ids, -1 past its size."""
    out = torch.full((vocab,), -1, dtype=torch.long)
    out[:len(ids)] = torch.tensor(ids)
    return out


def _reduced(target, subset=SUBSET, **kw):
    """An engine whose head was synced a reduced draft vocabulary, as a trainer's weight sync sends it."""
    engine = _engine(target, HEAD, **kw)
    engine.load_weights([("draft_head.draft_vocab", _subset(subset))], version=1)
    return engine


def _record(engine) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every proposal's drafts and distributions, from now on."""
    drafter, seen = engine._spec.drafter, []
    propose = drafter.propose

    def spy(*args, **kwargs):
        drafts, q = propose(*args, **kwargs)
        seen.append((drafts.clone(), None if q is None else q.clone()))
        return drafts, q

    drafter.propose = spy
    return seen


def test_greedy_outputs_are_plain_decodings_and_drafts_stay_in_the_subset(target):
    prompts = [[1, 2, 3], [4, 5], [3, 1, 4, 1, 5], [2], [0, 4], [3, 3, 3]]
    params = SamplingParams(0.0, 1.0, 0, 9, [5])
    plain = _engine(target).generate(prompts, params, n=2)
    full, reduced = _engine(target, HEAD, max_batch_size=4), _reduced(target, max_batch_size=4)
    seen = {"full": _record(full), "reduced": _record(reduced)}
    for engine in (full, reduced):
        got = engine.generate(prompts, params, n=2)
        for a, b in zip(itertools.chain(*plain), itertools.chain(*got)):
            assert a.token_ids == b.token_ids and np.allclose(a.logprobs, b.logprobs, atol=1e-5)
            assert a.finish_reason == b.finish_reason
    drafted = {k: set(torch.cat([d.flatten() for d, _ in v]).tolist()) for k, v in seen.items()}
    assert drafted["reduced"] <= set(SUBSET)
    assert drafted["full"] - set(SUBSET)  # the same head drafts other tokens with the whole vocabulary
    assert 1.0 < reduced.step_metrics()["spec_accept_len"]


def test_the_graphed_step_path_on_cpu_gives_the_eager_outputs(target, monkeypatch):
    """The CUDA-graph path (each replay run eagerly) with a reduced vocabulary: the target's
    greedy outputs, the eager path's acceptance counts."""
    from miles_plugin_torch_engine import spec_graphs
    from miles_plugin_torch_engine.cuda_graphs import DecodeRunner

    prompts = [[1, 2, 3], [4, 5], [3, 1, 4, 1, 5], [2], [0, 4], [3, 3, 3], [1, 1]]
    params = SamplingParams(0.0, 1.0, 0, 16, [5])
    plain = _engine(target).generate(prompts, params, n=1)
    eager, graphed = _reduced(target, max_batch_size=4), _reduced(target, max_batch_size=4)
    want = eager.generate(prompts, params, n=1)
    monkeypatch.setattr(spec_graphs, "capture_graph", _Replayed)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(DecodeRunner, "LENGTH_STEP", 1)
    graphed._spec.graphs.use_graphs, graphed._spec.sync_every = True, 2
    got = graphed.generate(prompts, params, n=1)
    assert graphed._spec.graphs._graphs
    for a, b in zip(itertools.chain(*plain), itertools.chain(*got)):
        assert a.token_ids == b.token_ids and np.allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert [c.extras for c in itertools.chain(*got)] == [c.extras for c in itertools.chain(*want)]


def test_samples_keep_the_targets_distribution(target):
    """Total-variation distance of speculative and plain samples within what two independent
    samples of the exact distribution show, with a draft that puts no probability outside its
    three tokens (the residual covers the rest)."""
    N = 3000
    params = SamplingParams(1.0, 1.0, 0, STEPS, [], seed=3)
    want = exact(target, PROMPT, STEPS, VOCAB, params)
    keys, p = list(want), np.array(list(want.values()))
    engine = _reduced(target)
    seen = _record(engine)
    spec = empirical(engine.generate([PROMPT], params, n=N)[0], keys)
    plain = empirical(_engine(target).generate([PROMPT], params, n=N)[0], keys)
    bound = tv_bound(p, N)
    assert tv(spec, plain) < bound and tv(spec, p) < bound
    assert 0.0 < engine.step_metrics()["spec_accept_rate"] < 1.0
    outside = [i for i in range(VOCAB) if i not in SUBSET]
    for drafts, q in seen:  # q is a distribution over the target's vocabulary, zero outside the subset
        assert set(drafts.flatten().tolist()) <= set(SUBSET)
        assert torch.all(q[..., outside] == 0) and torch.allclose(q.sum(-1), torch.ones(()))


def test_the_subset_and_its_lm_rows_follow_weight_syncs(target):
    engine = _reduced(target)
    drafter, params = engine._spec.drafter, SamplingParams(0.0, 1.0, 0, 4, [])
    engine.generate([PROMPT], params)
    assert drafter.ids.tolist() == SUBSET
    lm, ptr = drafter.lm, drafter.lm.data_ptr()
    assert torch.equal(lm, engine.model.lm_head.weight[SUBSET])
    new = torch.randn_like(engine.model.lm_head.weight)
    engine.load_weights([("lm_head.weight", new), ("draft_head.draft_vocab", _subset([0, 2, 5]))], version=2)
    engine.generate([PROMPT], params)
    # refilled in place (a captured graph reads the same buffers) from the synced weights
    assert drafter.ids.tolist() == [0, 2, 5] and drafter.lm.data_ptr() == ptr
    assert torch.equal(drafter.lm, new[[0, 2, 5]])
    engine.load_weights([("draft_head.draft_vocab", torch.arange(VOCAB))], version=3)
    engine.generate([PROMPT], params)
    assert drafter.ids is None  # every token again: the whole LM head


def test_a_head_file_brings_its_subset_to_the_engine(target, tmp_path):
    """``engine.speculative.path``: the exported head's ``draft_vocab`` is the engine's subset."""
    from miles_draft.files import save_head
    from miles_draft.head import make_head

    head = make_head(target.config, torch.device("cpu"), torch.float32, draft_vocab=len(SUBSET))
    head.draft_vocab.copy_(_subset(SUBSET))
    save_head(dict(head.state_dict()), str(tmp_path))
    engine = _engine(target, {**HEAD, "path": str(tmp_path)})
    params = SamplingParams(0.0, 1.0, 0, 6, [])
    got = engine.generate([PROMPT, [4, 5]], params)
    assert engine._spec.drafter.ids.tolist() == SUBSET
    assert [c[0].token_ids for c in got] == [c[0].token_ids for c in _engine(target).generate([PROMPT, [4, 5]], params)]
