"""Speculative decoding with the MTP layer of Qwen3-Next and Qwen3.5/3.6 MoE, whose gated-DeltaNet
layers keep a convolution window and a recurrent state per row: after a step every row's state is
the one after exactly its accepted tokens, so greedy tokens are plain decoding's, and the returned
log-probs are the target's (a transformers forward of the same tokens) at any temperature."""
from __future__ import annotations

import copy
import functools
import itertools

import numpy as np
import pytest
import torch
from miles import SamplingParams, make_plugin_manager
from test_speculative_mtp import _engine, _fit, _Spec

from miles_plugin_torch_engine.hf_speculative import LinearStates

VOCAB = 6
pytestmark = pytest.mark.usefixtures("single_thread")
# a gated DeltaNet layer (4-token convolution window), gated full attention, another DeltaNet layer;
# the MTP layer: full attention over the experts
QWEN3_NEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
              "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
              "num_experts_per_tok": 2, "mtp_num_hidden_layers": 1,
              "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
FAMILIES = ("qwen3_next", "qwen3_5_moe_text")
MTP = {"draft": "mtp", "tokens": 3, "max_batch": 1 << 20}
PROMPTS = [[1, 2, 3], [4, 5], [3, 1, 4, 1, 5, 2], [2], [1, 4], [3, 3, 3, 2, 1]]  # shorter and longer than the window


@functools.cache  # engines deep-copy the model: one build per family serves every test
def _spec(family: str) -> _Spec:
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = make_plugin_manager().create("architectures", family, None)
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0, **QWEN3_NEXT)
    model = AutoModelForCausalLM.from_config(config).eval()
    (block,) = arch.attach_mtp(model, None)
    with torch.no_grad():  # sharper distributions than the default init: rejections matter
        model.lm_head.weight.mul_(4.0)
    _fit(model, block)
    return _Spec(model, arch)


@pytest.fixture(scope="module", params=FAMILIES)
def family_spec(request):
    return _spec(request.param)


def _target_logprobs(model, prompt, tokens, temperature: float) -> np.ndarray:
    """The target's log-probs of ``tokens`` after ``prompt``: one transformers forward, no cache."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).numpy()


def test_each_rows_linear_state_is_the_one_after_its_accepted_tokens():
    """``LinearStates.keep`` after one verify block of 4 tokens, rows keeping 1 to 4 of them: each
    row's convolution window and recurrent state equal those of decoding its kept tokens one by one."""
    from transformers.cache_utils import LinearAttentionLayer

    model = _spec("qwen3_next").model
    ids = torch.tensor([[0, 0, 1, 2], [3, 1, 4, 1], [0, 0, 0, 5], [2, 2, 3, 4]])
    mask = (ids > 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    block = torch.tensor([[1, 2, 3, 4], [5, 1, 2, 3], [4, 4, 1, 1], [3, 2, 1, 5]])
    fed = torch.tensor([1, 4, 2, 3])
    with torch.no_grad():
        cache = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True).cache
        ref = copy.deepcopy(cache)
        states = LinearStates(cache, 4)
        model.model(input_ids=block, attention_mask=torch.cat([mask, torch.ones_like(block)], 1),
                    position_ids=pos[:, -1:] + 1 + torch.arange(4), use_cache=True, cache=cache)
        states.keep(fed, 0)
        want = {}
        for b in range(4):
            one = copy.deepcopy(ref)
            one.reorder_cache(torch.tensor([b]))
            for t in range(int(fed[b])):
                seen = torch.cat([mask[b:b + 1], torch.ones((1, t + 1), dtype=torch.long)], 1)
                model.model(input_ids=block[b:b + 1, t:t + 1], attention_mask=seen,
                            position_ids=pos[b:b + 1, -1:] + 1 + t, use_cache=True, cache=one)
            want[b] = [(layer.conv_states[0], layer.recurrent_states[0]) for layer in one.layers
                       if isinstance(layer, LinearAttentionLayer)]
    got = [(layer.conv_states[0], layer.recurrent_states[0]) for layer in states.layers]
    assert len(got) == 2
    for b in range(4):
        for (conv, rec), (want_conv, want_rec) in zip(got, want[b]):
            assert torch.allclose(conv[b], want_conv[0], atol=1e-6)
            assert torch.allclose(rec[b], want_rec[0], atol=1e-6)
            assert not torch.allclose(rec[b], rec[(b + 1) % 4], atol=1e-3)  # rows' states differ


def test_greedy_tokens_are_plain_decodings_and_logprobs_the_targets(family_spec):
    params = SamplingParams(0.0, 1.0, 0, 9, [5])  # rows stop at different steps
    plain = _engine(family_spec).generate(PROMPTS, params, n=2)
    engine = _engine(family_spec, MTP)
    spec = engine.generate(PROMPTS, params, n=2)
    lengths = set()
    for prompt, a, b in zip(itertools.chain(*([p, p] for p in PROMPTS)), itertools.chain(*plain),
                            itertools.chain(*spec)):
        assert a.token_ids == b.token_ids
        assert b.finish_reason == a.finish_reason
        assert np.allclose(b.logprobs, _target_logprobs(family_spec.model, prompt, b.token_ids, 1.0), atol=1e-5)
        lengths.add(len(b.token_ids))
    assert len(lengths) > 1  # rows finished at different steps
    m = engine.step_metrics()
    # drafts both accepted and rejected: rows of one batch kept different numbers of tokens
    assert 0.0 < m["spec_accept_rate"] < 1.0
    assert 1.0 < m["spec_accept_len"] < 1 + MTP["tokens"]
    assert engine.engine_stats()[0]["spec_accept_rate"] > 0.0
    assert engine.step_metrics() == {}  # drained
    one = _engine(family_spec, MTP).generate([PROMPTS[2]], params, n=1)[0][0]  # a row alone: crops, no holes
    assert one.token_ids == plain[2][0].token_ids


def test_sampled_logprobs_are_the_targets(family_spec):
    params = SamplingParams(1.0, 1.0, 0, 8, [5], seed=3)
    engine = _engine(family_spec, {**MTP, "tokens": 2})
    out = engine.generate(PROMPTS[:4], params, n=3)
    for prompt, comps in zip(PROMPTS, out):
        for c in comps:
            assert np.allclose(c.logprobs, _target_logprobs(family_spec.model, prompt, c.token_ids, 1.0), atol=1e-5)
    assert len({tuple(c.token_ids) for c in out[0]}) > 1  # sampled, not greedy
    m = engine.step_metrics()
    assert 0.0 < m["spec_accept_rate"] < 1.0



def test_weight_syncs_reach_the_drafting_mtp_block(family_spec):
    engine = _engine(family_spec, MTP)
    name = "mtp.fc.weight"  # the checkpoint's name
    new = torch.full_like(dict(engine.model.named_parameters())[name], 0.5)
    engine.load_weights([(name, new)], version=3)
    assert torch.equal(engine._mtp.layer.fc.weight, new)
