"""The engine's draft head drafts what training's whole-sequence form of the head predicts: at
temperature 0 every proposal (k chained drafts from a row's last token) equals the greedy chain of
``DraftHead.chains`` over the finished sequence's target hidden states, with continuous batching
(rows joining mid-decode and moving between cache rows)."""
from __future__ import annotations

import pytest
import torch
from miles import SamplingParams
from miles_draft.head import embed, head_logits

from test_speculative import _engine, _model

pytestmark = pytest.mark.usefixtures("single_thread")
K = 3


def _chains(model, head, seq: list[int], keys: torch.Tensor | None = None) -> list[list[int]]:
    """Greedy drafts of every chain start ``0 .. len(seq) - 2`` of ``seq``: ``[start][step]``."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][:, :-1]
        starts = torch.arange(len(seq) - 1)[None]
        feed = lambda s, f: embed(model, head_logits(model, f).argmax(-1))  # noqa: E731
        outs = head.chains(hidden, embed(model, ids[:, 1:]), starts, K, feed, keys)
    return torch.stack([head_logits(model, f).argmax(-1)[0] for f in outs], 1).tolist()


def test_engine_drafts_equal_the_heads_whole_sequence_chains():
    target = _model(0, vocab=16)
    engine = _engine(target, {"draft": "head", "tokens": K, "max_batch": 1 << 20}, max_batch_size=3)
    gen = engine._spec
    head = gen.drafter.head
    torch.manual_seed(1)
    with torch.no_grad():  # a head whose attention matters: weights far from the identity start
        for p in head.parameters():
            p.add_(0.5 * torch.randn_like(p))
    logged = []
    propose = gen.drafter.propose

    def spy(live, last, pos, k, *a, **kw):
        drafts, q = propose(live, last, pos, k, *a, **kw)
        logged.extend((gen.rows.owner[b], int(pos[b]), drafts[b].tolist()) for b in range(live))
        return drafts, q

    gen.drafter.propose = spy
    prompts = [[1, 2, 3, 4, 5, 6, 7], [4, 5], [3, 1, 4, 1, 5, 9, 2, 6], [2], [8, 4, 8, 4]]
    out = engine.generate(prompts, SamplingParams(0.0, 1.0, 0, 12, []), n=1)
    assert gen.stats["joined_mid_decode"] > 0
    seqs = {(i, 0): prompts[i] + out[i][0].token_ids for i in range(len(prompts))}
    want = {key: _chains(engine.model, head, seq) for key, seq in seqs.items()}
    assert len(logged) > 20
    for owner, pos, drafts in logged:
        assert drafts == want[owner][pos - 1], (owner, pos)
    # the drafts read the context: attending only its own entry drafts otherwise somewhere
    alone = {key: _chains(engine.model, head, seq, keys=torch.zeros(1, len(seq) - 1, dtype=torch.bool))
             for key, seq in seqs.items()}
    assert any(alone[o][p - 1] != d for o, p, d in logged)
