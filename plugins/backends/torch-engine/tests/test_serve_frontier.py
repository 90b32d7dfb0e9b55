"""``miles serve`` on each frontier family (DeepSeek-V3/V4, GLM-4.5, GLM-5, Qwen3.5 MoE, Qwen3-Next,
gpt-oss), built in-process as the command builds it (``served_spec``, ``TorchEngine`` on its default
settings, ``Scheduler``, ``build_app``) over a tiny random Hugging Face folder: SGLang's
``/generate`` answers what the engine generates directly, with log-probs of transformers' own
forward and the experts each token went to; ``/v1/completions`` answers; requests that arrive
together run as one batch and answer as they would alone."""
from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch
from miles import SamplingParams
from miles.testing.arch import reference_logprobs
from miles_tinypolicy import char_tokenizer
from miles_tinypolicy.frontier import FAMILIES, write_frontier_policy

from miles_plugin_torch_engine.hf_slots import SlotGenerator
from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine
from miles_plugin_torch_engine.scheduler import Scheduler
from miles_plugin_torch_engine.server import FolderSpec, build_app, served_spec

pytestmark = pytest.mark.usefixtures("single_thread")
# different lengths: left-padded together, or (DeepSeek-V4) one forward per length
PROMPTS = [[2, 5, 6, 7, 8, 9, 10, 11, 12, 13], [2, 11], [2, 12, 13, 14, 15], [2, 20, 21, 22, 23]]
NEW, N = 8, 2


class Served:
    """One family's folder, its served app and a plain engine over the same folder."""

    def __init__(self, family: str, folder: str):
        self.family, self.folder = family, folder
        cfg = TorchEngineConfig()  # what `miles serve FOLDER` runs with no settings
        self.spec = spec = served_spec(folder, cfg)
        self.engine = TorchEngine(cfg, spec=spec, tokenizer=spec.build_tokenizer(), seed=0)
        self.scheduler = Scheduler(self.engine)
        self.app = build_app(self.engine, self.scheduler, model_dir=folder)
        self.eos = self.engine.tokenizer.eos_token_id

    def ask(self, *calls: tuple[str, str, dict]) -> list[httpx.Response]:
        """The calls, one after another, on one client."""
        async def main():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t",
                                         timeout=60) as c:
                return [await c.request(method, path, json=body) for method, path, body in calls]
        return asyncio.run(main())


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    write_frontier_policy(folder, request.param, char_tokenizer())
    s = Served(request.param, str(folder))
    yield s
    s.scheduler.stop()


def generate_body(prompts, n=N, new=NEW, **kw):
    return {"input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": new, "n": n},
            "return_logprob": True, **kw}


def routed(meta: dict) -> np.ndarray:
    shape = meta["routed_experts_shape"]
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(shape)


def test_generate_answers_the_engines_tokens_with_transformers_logprobs_and_routed_experts(served):
    from transformers import AutoModelForCausalLM

    # the model's own forward (no built-in path for these families) under the continuous batcher
    assert isinstance(served.engine._fast, SlotGenerator)
    (r,) = served.ask(("POST", "/generate", generate_body(PROMPTS, return_routed_experts=True)))
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out) == len(PROMPTS) * N
    plain = TorchEngine(TorchEngineConfig(), spec=FolderSpec(served.folder), tokenizer=served.engine.tokenizer,
                        seed=0)
    want = plain.generate(PROMPTS, SamplingParams(0.0, 1.0, 0, NEW, [served.eos]), n=N)
    reference = AutoModelForCausalLM.from_pretrained(served.folder).eval()  # transformers alone
    cfg = reference.config
    layers = len(served.spec.architecture().routers(served.engine.model))
    assert layers >= 1
    hooked = served.spec.build_model(served.engine.tokenizer).eval()  # the folder's model, its routers recording
    recorder = served.spec.routing_recorder(hooked)
    worst = 0.0
    for k, o in enumerate(out):  # SGLang's order: every prompt's first sample, then the second ones
        prompt, comp = PROMPTS[k % len(PROMPTS)], want[k % len(PROMPTS)][k // len(PROMPTS)]
        tokens = o["output_ids"]
        assert tokens == comp.token_ids, f"{served.family}: sample {k}"
        assert tokens, f"{served.family}: sample {k} is empty"
        lps = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        assert [t for _, t, _ in o["meta_info"]["output_token_logprobs"]] == tokens
        worst = max(worst, (reference_logprobs(reference, prompt, tokens) - torch.tensor(lps)).abs().max().item())
        experts = routed(o["meta_info"])
        assert experts.shape == (len(prompt) + len(tokens) - 1, layers, cfg.num_experts_per_tok)
        n_experts = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", None) or cfg.num_local_experts
        assert experts.min() >= 0 and experts.max() < n_experts
        with torch.no_grad(), recorder.recording():  # every fed token's experts in one forward, unpadded
            hooked(input_ids=torch.tensor([prompt + tokens[:-1]]), use_cache=False)
        (whole,) = recorder.take()
        assert np.array_equal(np.sort(experts, -1), np.sort(whole.numpy(), -1)), f"{served.family}: sample {k}"
        assert (np.sort(experts, -1)[..., 1:] != np.sort(experts, -1)[..., :-1]).all()  # top-k: distinct
        if k >= len(PROMPTS):  # greedy: the second sample routes as the first
            assert np.array_equal(experts, routed(out[k - len(PROMPTS)]["meta_info"]))
    assert worst < 1e-5, f"{served.family}: log-probs differ from transformers' forward by {worst:.2e}"


def test_openai_completions_answer_the_greedy_tokens(served):
    prompt = PROMPTS[2]
    (r, g) = served.ask(("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0}),
                        ("POST", "/generate", generate_body(prompt, n=1, new=6)))
    assert r.status_code == 200 and g.status_code == 200, r.text + g.text
    choice, want = r.json()["choices"][0], g.json()["output_ids"]
    assert choice["token_ids"] == want and r.json()["usage"]["completion_tokens"] == len(want)
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)
    finish = "length" if len(want) == 6 else "stop"
    assert choice["finish_reason"] == finish and (finish == "length" or want[-1] == served.eos)


def test_requests_arriving_together_run_as_one_batch_and_answer_as_alone(served):
    """Requests queued while generation is paused run together in one scheduler batch (prompts of
    several requests in one engine call); each answers what it answers sent alone."""
    bodies = [generate_body(PROMPTS[:2]), generate_body([PROMPTS[2]], n=1), generate_body(PROMPTS[3], n=3),
              generate_body([PROMPTS[1], PROMPTS[0]])]
    alone = [r.json() for r in served.ask(*[("POST", "/generate", b) for b in bodies])]
    stats = dict(served.scheduler.stats)

    async def together():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served.app), base_url="http://t",
                                     timeout=60) as c:
            assert (await c.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
            calls = [asyncio.ensure_future(c.post("/generate", json=b)) for b in bodies]
            while served.scheduler.num_waiting < len(bodies):
                await asyncio.sleep(0.005)
            assert (await c.post("/continue_generation")).status_code == 200
            return await asyncio.gather(*calls)

    answers = asyncio.run(together())
    assert [a.status_code for a in answers] == [200] * len(bodies)
    assert served.scheduler.stats["num_batches"] == stats["num_batches"] + 1
    assert served.scheduler.stats["num_engine_calls"] == stats["num_engine_calls"] + 1  # one sampling setting
    for a, b in zip(answers, alone):
        got = a.json() if isinstance(a.json(), list) else [a.json()]
        b = b if isinstance(b, list) else [b]
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in b]
        for x, y in zip(got, b):
            lx = [lp for lp, _, _ in x["meta_info"]["output_token_logprobs"]]
            ly = [lp for lp, _, _ in y["meta_info"]["output_token_logprobs"]]
            assert np.allclose(lx, ly, atol=1e-5), (lx, ly)
