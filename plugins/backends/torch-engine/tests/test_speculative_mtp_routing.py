"""Rollout routing replay (R3) with the MTP layer drafting (engine.speculative draft mtp): a
completion's routed experts are the target's routes of the tokens each row kept from every verify
block (never a rejected draft's), so they equal what re-running the model over the sample records,
and the trainer's replay of them gives the engine's log-probs."""
from __future__ import annotations

import functools
import itertools

import pytest
import torch
from miles import Batch, Sample, SamplingParams, Task, make_plugin_manager
from test_speculative_mtp import _fit

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine

pytestmark = pytest.mark.usefixtures("single_thread")
# test_speculative_mtp.py's tiny DeepSeek-V3 with two MoE layers, so that records have a layer axis
DEEPSEEK = {"model_type": "deepseek_v3", "vocab_size": 8, "hidden_size": 32, "intermediate_size": 64,
            "moe_intermediate_size": 16, "num_hidden_layers": 3, "first_k_dense_replace": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4, "n_group": 1,
            "topk_group": 1, "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "num_nextn_predict_layers": 1,
            "max_position_embeddings": 256}
LAYERS, TOP_K = 2, 2
MTP = {"draft": "mtp", "tokens": 3, "max_batch": 1 << 20}
PROMPTS = [[1, 2, 3], [4, 5], [3, 1, 4, 1, 5, 2], [2], [6, 7, 1, 2]]


class _Tok:
    eos_token_id, pad_token_id = None, 0

    def __len__(self) -> int:
        return DEEPSEEK["vocab_size"]


@functools.cache
def _setup() -> tuple:
    """The ``moe`` spec (routing replay on, over the hf spec, which attaches the MTP layer) and an
    engine drafting with that layer, fitted so that its drafts are often but not always kept."""
    pm = make_plugin_manager()
    settings = pm.registry("model_specs")["moe"].config.model_validate(
        {"base": {"name": "hf", "config": DEEPSEEK}, "routing_replay": True})
    spec = pm.create("model_specs", "moe", settings, pm=pm)
    torch.manual_seed(0)
    engine = TorchEngine(TorchEngineConfig.model_validate({"speculative": MTP}), spec=spec, tokenizer=_Tok(), seed=1)
    with torch.no_grad():  # sharper distributions than the default init: rejections matter
        engine.model.lm_head.weight.mul_(4.0)
    _fit(engine.model, engine._mtp.layer, steps=60)
    return spec, engine


def _rerun(spec, model, prompt, response) -> torch.Tensor:
    """The routes a plain forward of ``prompt + response[:-1]`` records."""
    recorder = spec.routing_recorder(model)
    with torch.no_grad(), recorder.recording():
        model(input_ids=torch.tensor([list(prompt) + list(response[:-1])]))
    (forward,) = recorder.take()
    return forward


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_records_keep_only_the_kept_positions_and_replay_gives_the_engines_logprobs(temperature):
    spec, engine = _setup()
    params = SamplingParams(temperature, 1.0, 0, 10, [5], seed=7)  # rows stop at different steps
    out = engine.generate(PROMPTS, params, n=2)
    m = engine.step_metrics()  # drafted, with drafts both accepted and rejected
    assert 0.0 < m["spec_accept_rate"] < 1.0
    assert len({len(c.token_ids) for c in itertools.chain(*out)}) > 2
    samples = []
    for prompt, comps in zip(PROMPTS, out):
        for c in comps:
            rec = c.extras["moe"]["routed_experts"]
            assert rec.dtype == torch.int32
            assert tuple(rec.shape) == (len(prompt) + len(c.token_ids) - 1, LAYERS, TOP_K)
            # the same experts, as sets (top-k order may differ between forwards of other shapes)
            want = _rerun(spec, engine.model, prompt, c.token_ids)
            assert torch.equal(rec.sort(-1).values, want.sort(-1).values)
            samples.append(Sample(task=Task(prompt=""), prompt_ids=prompt, response_ids=c.token_ids,
                                  logprobs=c.logprobs, loss_mask=[1] * len(c.token_ids), extensions=dict(c.extras)))
    trainer = spec.build_model(_Tok())  # the trainer's copy of the engine's (float32) weights
    trainer.load_state_dict(engine.model.state_dict())
    batch = Batch.from_samples(samples, _Tok.pad_token_id)
    with torch.no_grad():
        lp = spec.action_logprobs(trainer, batch)
    mask = batch.loss_mask.bool()
    assert (lp - batch.rollout_logprobs)[mask].abs().max() < 1e-5


def test_greedy_records_are_the_plain_engines():
    """At temperature 0 the plain engine generates the same tokens; its one-token decodes record
    the same routes as the verify blocks' kept positions, row for row."""
    spec, engine = _setup()
    plain = TorchEngine(TorchEngineConfig(), spec=spec, tokenizer=_Tok(), seed=1)
    plain.model.load_state_dict(engine.model.state_dict())
    params = SamplingParams(0.0, 1.0, 0, 10, [5])
    for a, b in zip(itertools.chain(*plain.generate(PROMPTS, params, n=2)),
                    itertools.chain(*engine.generate(PROMPTS, params, n=2))):
        assert a.token_ids == b.token_ids
        ra, rb = a.extras["moe"]["routed_experts"], b.extras["moe"]["routed_experts"]
        assert torch.equal(ra.sort(-1).values, rb.sort(-1).values)
    assert 0.0 < engine.step_metrics()["spec_accept_rate"] < 1.0


def test_a_served_folder_with_recording_routers_drafts_with_its_mtp_layer(tmp_path):
    """``miles serve``'s spec stack: a mixture-of-experts folder with the ``moe`` spec's recording
    routers (``with_routing``) names its architecture, so its stored MTP layer drafts, and the
    records are the re-run model's."""
    from miles_plugin_torch_engine.routing import with_routing
    from miles_plugin_torch_engine.server import FolderSpec

    _, src = _setup()
    folder = str(tmp_path / "model")
    src.model.save_pretrained(folder)
    served = with_routing(FolderSpec(folder), folder)
    engine = TorchEngine(TorchEngineConfig.model_validate({"speculative": MTP}), spec=served, tokenizer=_Tok(), seed=1)
    assert engine._mtp is not None
    out = engine.generate(PROMPTS[:3], SamplingParams(1.0, 1.0, 0, 10, [5], seed=11), n=2)
    assert 0.0 < engine.step_metrics()["spec_accept_rate"] < 1.0
    for prompt, comps in zip(PROMPTS, out):
        for c in comps:
            want = _rerun(served, engine.model, prompt, c.token_ids)
            assert torch.equal(c.extras["moe"]["routed_experts"].sort(-1).values, want.sort(-1).values)
