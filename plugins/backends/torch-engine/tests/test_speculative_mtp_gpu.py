"""The mtp draft on CUDA (the model's own forward, MLA decoding over its latent for DeepSeek-V3):
greedy tokens are the plain path's and log-probs the target's at batch 1 and 8 in float32, and a
bfloat16 engine samples with the target's log-probs
(``python -m pytest -m gpu plugins/backends/torch-engine/tests/test_speculative_mtp_gpu.py``)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from miles import SamplingParams
from test_speculative_mtp import CONFIGS, _spec, _Tok

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MTP = {"draft": "mtp", "tokens": 3, "max_batch": 64}
DEVICE = "cuda"


def _engine(spec, speculative=None, **kw) -> TorchEngine:
    extra = {"speculative": speculative} if speculative else {}
    cfg = TorchEngineConfig.model_validate({"device": DEVICE, **kw, **extra})
    return TorchEngine(cfg, spec=spec, tokenizer=_Tok(), seed=1)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("rows", [1, 8])
def test_greedy_tokens_and_logprobs_are_the_targets_on_cuda(family, rows):
    spec = _spec(family, 32)
    prompts = [[1 + i, 2, 3 + i, 4][: 2 + i % 3] for i in range(rows)]
    params = SamplingParams(0.0, 1.0, 0, 40, [])
    plain = _engine(spec).generate(prompts, params)
    engine = _engine(spec, MTP)
    drafted = engine.generate(prompts, params)
    for a, b in zip(itertools.chain(*plain), itertools.chain(*drafted)):
        assert a.token_ids == b.token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
    m = engine.step_metrics()
    assert 1.0 < m["spec_accept_len"] <= 1 + MTP["tokens"]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bfloat16_samples_carry_the_targets_logprobs(family):
    spec = _spec(family, 32)
    engine = _engine(spec, MTP, dtype="bfloat16")
    comps = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(1.0, 1.0, 0, 24, [], seed=0), n=4)
    comps = list(itertools.chain(*comps))
    assert all(len(c.token_ids) == 24 for c in comps)
    scored = engine.logprobs([[1, 2, 3]] * 4 + [[4, 5]] * 4, [c.token_ids for c in comps])
    for c, lp in zip(comps, scored):  # block and one-token forwards round differently in bfloat16
        assert np.allclose(c.logprobs, lp, atol=0.1)
    m = engine.step_metrics()
    assert 0.0 < m["spec_accept_rate"] < 1.0
