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
    # the engine's load reading (EngineStats) under stable names, read back by the sglang client
    assert families["miles_engine_generated_tokens"].type == "counter"
    assert 2.0 <= samples["miles_engine_generated_tokens_total"] <= 6.0  # two requests of 1-3 tokens
    assert samples["miles_engine_generated_tokens_total"] == engine.engine_stats()[0]["generated_tokens"]
    assert samples["miles_engine_running_sequences"] == samples["miles_engine_queued_sequences"] == 0.0
    assert samples["miles_engine_kv_cache_usage"] == 0.0 and "miles_engine_spec_accept_rate" not in samples
    from miles_telemetry.prom import engine_reading

    assert engine_reading(r.text) == {"running": 0.0, "queued": 0.0, "kv_cache_usage": 0.0,
                                      "generated_tokens": samples["miles_engine_generated_tokens_total"]}


def test_metrics_need_the_api_key():
    engine = TorchEngine(TorchEngineConfig(), spec=TinySpec(), tokenizer=char_tokenizer(), seed=0)
    app = build_app(engine, Scheduler(engine), model_dir="mem", api_key="sekrit")

    async def get(headers):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/metrics", headers=headers)
    assert asyncio.run(get({})).status_code == 401
    ok = asyncio.run(get({"Authorization": "Bearer sekrit"}))
    assert ok.status_code == 200 and "miles_engine_requests_total" in ok.text


def test_queued_sequences_count_the_samples_of_queued_requests():
    """While generation is paused a request waits in the scheduler: its prompts x n are queued
    sequences (what a client's engine_stats() shows as queued)."""
    torch.set_num_threads(1)
    engine = TorchEngine(TorchEngineConfig(), spec=TinySpec(), tokenizer=char_tokenizer(), seed=0)
    scheduler = Scheduler(engine)
    app = build_app(engine, scheduler, model_dir="mem")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
            body = {"text": ["1+2=", "3+4="], "sampling_params": {"max_new_tokens": 2, "n": 3}}
            pending = asyncio.create_task(c.post("/generate", json=body))
            while scheduler.num_waiting == 0:
                await asyncio.sleep(0.01)
            queued = (await c.get("/metrics")).text
            await c.post("/continue_generation")
            assert (await pending).status_code == 200
            return queued, (await c.get("/metrics")).text
    queued, after = asyncio.run(go())
    samples = {s.name: s.value for f in text_string_to_metric_families(queued) for s in f.samples}
    assert samples["miles_engine_queued_sequences"] == 6.0 and samples["miles_engine_running_sequences"] == 0.0
    samples = {s.name: s.value for f in text_string_to_metric_families(after) for s in f.samples}
    assert samples["miles_engine_queued_sequences"] == 0.0 and samples["miles_engine_generated_tokens_total"] >= 6
