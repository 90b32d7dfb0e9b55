"""Each drafted completion's verify steps and drafts, as ``miles serve`` answers them in
``meta_info`` (SGLang's ``spec_verify_ct``, ``spec_accept_token_num``, ``spec_draft_token_num``),
agree with the engine's own acceptance counters; the ``sglang`` client reads them back into
``spec_accept_len`` and ``spec_accept_rate``."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
from miles import SamplingParams
from miles.testing import TinySpec, char_tokenizer

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine
from miles_plugin_torch_engine.scheduler import Scheduler
from miles_plugin_torch_engine.server import build_app

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = [[2, 5, 6], [3, 4], [7, 8, 9, 10], [5]]


def _head_engine() -> tuple[TorchEngine, int]:
    k = 2
    cfg = TorchEngineConfig.model_validate({"speculative": {"draft": "head", "tokens": k, "max_batch": 8}})
    return TorchEngine(cfg, spec=TinySpec(), tokenizer=char_tokenizer(), seed=0), k


def _mtp_engine() -> tuple[TorchEngine, int]:
    from test_speculative_mtp import MTP, _spec

    return TorchEngine(TorchEngineConfig.model_validate({"speculative": {**MTP, "max_batch": 8}}),
                       spec=_spec("deepseek_v3"), tokenizer=char_tokenizer("abc"), seed=0), MTP["tokens"]


def _post(app, body: dict) -> list[dict]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/generate", json=body)

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    return r.json()


def _deferred_head_engine() -> tuple[TorchEngine, int]:
    """The head engine reading the rows' flags every 3 steps, as on CUDA: steps a finished row
    decodes before it is retired are not its verify steps."""
    engine, k = _head_engine()
    engine._spec.sync_every = 3
    return engine, k


@pytest.mark.parametrize("make", [_head_engine, _deferred_head_engine, _mtp_engine], ids=["head", "deferred", "mtp"])
def test_generate_answers_each_outputs_verify_steps_as_the_engine_counted_them(make):
    engine, k = make()
    prompts = [[t % engine.model.config.vocab_size for t in p] for p in PROMPTS[:2]]
    scheduler = Scheduler(engine)
    app = build_app(engine, scheduler, model_dir="mem")
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 12, "n": 3, "sampling_seed": 5}}
    try:
        outs = _post(app, body)
        engine_metrics = engine.step_metrics()  # the generators' own counters since the last call
        plain = _post(app, {**body, "sampling_params": {**body["sampling_params"], "n": 5}})  # 10 rows > 8
        plain_metrics = engine.step_metrics()
    finally:
        scheduler.stop()
    metas = [o["meta_info"] for o in outs]
    assert len(metas) == 6 and all("spec_verify_ct" in m for m in metas), metas
    tokens = verify = accepted = drafted = 0
    for m in metas:
        n, v, a = m["completion_tokens"], m["spec_verify_ct"], m["spec_accept_token_num"]
        assert m["spec_draft_token_num"] == v * k and 0 <= a <= v * k
        # every verify step emits its accepted drafts and one token more, only the last one may
        # stop short (stop token, token budget); the prefill emits the first token
        assert 0 <= v + a - (n - 1) <= k and (v > 0) == (n > 1), m
        tokens, verify, accepted, drafted = tokens + n - 1, verify + v, accepted + a, drafted + v * k
    assert verify > 0 and 0 < accepted < drafted  # partial acceptance: both sides of the check matter
    assert engine_metrics["spec_accept_len"] == pytest.approx(tokens / verify, rel=1e-12)
    assert engine_metrics["spec_accept_rate"] == pytest.approx(accepted / drafted, rel=1e-12)
    # a call above max_batch decodes without drafts: no verify steps to report
    assert len(plain) == 10 and not any("spec_verify_ct" in o["meta_info"] for o in plain)
    assert plain_metrics == {}


class _Served:
    """``build_app`` behind a real HTTP socket (uvicorn on a thread of this process)."""

    def __init__(self, engine: TorchEngine):
        import uvicorn

        self.scheduler = Scheduler(engine)
        app = build_app(engine, self.scheduler, model_dir="mem")
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.scheduler.stop()
        self.sock.close()


def test_the_sglang_client_reports_the_acceptance_of_what_it_received():
    from miles_plugin_sglang.config import SGLangEngineConfig
    from miles_plugin_sglang.engine import SGLangEngine

    engine, _ = _head_engine()
    served = _Served(engine)
    try:
        client = SGLangEngine(SGLangEngineConfig(urls=[served.url], startup_timeout_s=10))
        try:
            groups = client.generate(PROMPTS, SamplingParams(1.0, 1.0, 0, 12, [], seed=3), n=2)
            got = client.step_metrics()
            again = client.step_metrics()
        finally:
            client.close()
    finally:
        served.close()
    mine = engine.step_metrics()  # the server engine's own counters over the same completions
    lengths = [len(c.token_ids) for g in groups for c in g]
    assert len(lengths) == 8 and sum(n > 1 for n in lengths) >= 2  # drafted completions
    # tokens the verify steps emitted (each completion's first is its prefill's) / verify steps,
    # drafts accepted / proposed: what the in-process engine reports
    assert set(got) == {"spec_accept_len", "spec_accept_rate"} and 1.0 <= got["spec_accept_len"] <= 3.0
    assert got["spec_accept_len"] == pytest.approx(mine["spec_accept_len"], rel=1e-12)
    assert got["spec_accept_rate"] == pytest.approx(mine["spec_accept_rate"], rel=1e-12)
    assert again == {}  # drained: the next reading covers only later completions
