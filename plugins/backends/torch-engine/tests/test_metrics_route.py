"""``GET /metrics`` of miles serve's app, read by the official prometheus_client parser."""
import asyncio

import httpx
import torch
from miles.testing import TinySpec, char_tokenizer
from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine
from miles_plugin_torch_engine.scheduler import Scheduler
from miles_plugin_torch_engine.server import build_app
from prometheus_client.parser import text_string_to_metric_families


def scrape(app, headers=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            for text in ("1+2=", "3+4="):
                r = await c.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 3}},
                                 headers=headers)
                assert r.status_code == 200, r.text
            return await c.get("/metrics", headers=headers)
    return asyncio.run(go())


def test_metrics_parse_with_stable_names():
    torch.set_num_threads(1)
    engine = TorchEngine(TorchEngineConfig(), spec=TinySpec(), tokenizer=char_tokenizer(), seed=0)
    engine.weight_version = 7
    scheduler = Scheduler(engine)
    r = scrape(build_app(engine, scheduler, model_dir="mem"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = {s.name: s.value for f in families.values() for s in f.samples}
    assert families["miles_engine_requests"].type == "counter"
    assert samples["miles_engine_requests_total"] == 2.0
    assert samples["miles_engine_weight_version"] == 7.0
    assert samples["miles_engine_requests_queued"] == 0.0 and samples["miles_engine_requests_running"] == 0.0
    assert samples["miles_engine_batches_total"] >= 1.0


def test_metrics_need_the_api_key():
    engine = TorchEngine(TorchEngineConfig(), spec=TinySpec(), tokenizer=char_tokenizer(), seed=0)
    app = build_app(engine, Scheduler(engine), model_dir="mem", api_key="sekrit")

    async def get(headers):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/metrics", headers=headers)
    assert asyncio.run(get({})).status_code == 401
    ok = asyncio.run(get({"Authorization": "Bearer sekrit"}))
    assert ok.status_code == 200 and "miles_engine_requests_total" in ok.text
