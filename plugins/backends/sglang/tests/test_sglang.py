"""The ``sglang`` engine plugin without servers: config, registration, routing choices, response
parsing, the weights folder it writes. Against real ``miles serve`` processes (routing spread,
retries after kill -9, weight updates): tests/test_serve.py."""
import asyncio
import json
import socket

import pytest
from miles import Completion, MilesError, make_plugin_manager
import miles_wire as W
from miles.testing import assert_lazy_registration
from pydantic import ValidationError

from miles_plugin_sglang.config import SGLangEngineConfig
from miles_plugin_sglang.disk import write_version
from miles_plugin_sglang.engine import SGLangEngine, _join
from miles_plugin_sglang.router import Router


def test_registers_lazily_without_importing_torch():
    assert_lazy_registration("miles_plugin_sglang", "engines", "sglang")


def test_does_not_import_the_sglang_package():
    import subprocess
    import sys

    code = ("import sys, miles_plugin_sglang.engine, miles_plugin_sglang.router; "
            "assert 'sglang' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_validation():
    cfg = SGLangEngineConfig(urls=["http://127.0.0.1:30000/"])
    assert cfg.urls == ["http://127.0.0.1:30000"]
    for bad, word in (({"urls": []}, "urls"), ({"urls": ["127.0.0.1:30000"]}, "http"),
                      ({"urls": ["http://a:1", "http://a:1/"]}, "twice"),
                      ({"urls": ["http://a:1"], "ranks_per_server": [1, 2]}, "ranks_per_server"),
                      ({"urls": ["http://a:1"], "url": "x"}, "url")):
        with pytest.raises(ValidationError, match=word):
            SGLangEngineConfig(**bad)


def test_least_outstanding_then_round_robin():
    async def main():
        r = Router(["http://a", "http://b", "http://c"], api_key=None, timeout_s=1, max_retries=1,
                   max_concurrency=4)
        a, b, c = r.servers
        picks = [r.pick(set()).url for _ in range(6)]
        assert sorted(picks) == sorted(["http://a", "http://b", "http://c"] * 2)  # ties rotate
        a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
        assert r.pick(set()) is b
        assert r.pick({"http://b"}) is c
        c.healthy = False
        assert r.pick({"http://b"}) is a
        a.stale = True  # missed a weight update: never routed to
        assert r.pick({"http://b"}) is None
        await r.close()

    asyncio.run(main())


def test_a_server_error_is_retried_then_ends_the_run_with_its_message():
    """HTTP 500 from a live server: retried, never taken for a restart (which would re-push the
    weights forever), and the run ends with the server's own message; an unreachable server is
    routed around."""
    import httpx

    calls = []

    def answer(request):
        calls.append(request.url.path)
        if request.url.host == "b":
            raise httpx.ConnectError("refused")
        if request.url.path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": "3"})
        return httpx.Response(500, json={"error": {"message": "generation failed: boom"}})

    async def main():
        r = Router(["http://a", "http://b"], api_key=None, timeout_s=1, max_retries=2, max_concurrency=2)
        await r.close()
        r._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        r.weights_pushed = True
        with pytest.raises(MilesError, match="generation failed: boom"):
            await r.post("/generate", {})
        a, b = r.servers
        assert a.healthy and not a.restarted and not b.healthy
        assert calls.count("/generate") == 3  # max_retries + 1 attempts in all
        await r.close()

    asyncio.run(main())


def test_a_restart_between_two_requests_is_noticed_from_the_versions_reported():
    """A server that died and came back between two requests answers from its boot weights:
    versions never go back, so an older one in its answer (or in a health probe) marks it
    restarted; its answer is dropped and the request goes to a server that holds our weights,
    or ends in EngineRestarted (the loop re-syncs) when none does."""
    import httpx

    from miles import EngineRestarted

    booted = {"a"}  # hosts answering from their boot weights ("default", as SGLang at start)

    def answer(request):
        v = "default" if request.url.host in booted else "5"
        if request.url.path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": v})
        return httpx.Response(200, json={"output_ids": [7], "meta_info": {"weight_version": v}})

    async def main():
        r = Router(["http://a", "http://b"], api_key=None, timeout_s=1, max_retries=0, max_concurrency=2)
        await r.close()
        r._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        r.weights_pushed = True
        a, b = r.servers
        a.weight_version = b.weight_version = "5"
        out, server = await r.post("/generate", {})  # a is picked first (round robin), then b
        assert server is b and out["meta_info"]["weight_version"] == "5"
        assert a.stale and a.restarted and a.restarts == 1 and not b.stale
        with pytest.raises(EngineRestarted):  # b restarts too: nobody holds version 5
            booted.add("b")
            await r.post("/generate", {})
        assert b.stale and b.restarts == 1
        c = Router(["http://c"], api_key=None, timeout_s=1, max_retries=2, max_concurrency=1)
        await c.close()
        c._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        c.weights_pushed, c.servers[0].weight_version = True, "5"
        booted.add("c")
        await c.probe(c.servers[0])  # the health loop notices it as well
        assert c.servers[0].stale and c.servers[0].restarts == 1
        await r.close()
        await c.close()

    asyncio.run(main())


def test_an_output_aborted_before_it_ran_does_not_read_as_a_restart():
    """Only outputs that hold tokens tell which weights a server has: an aborted, empty one
    without a version is not a restart (it would make the loop push the same weights again)."""
    import httpx

    def answer(request):
        return httpx.Response(200, json=[
            {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "weight_version": None,
                                             "completion_tokens": 0}},
            {"output_ids": [3], "meta_info": {"weight_version": "5", "completion_tokens": 1}}])

    async def main():
        r = Router(["http://a"], api_key=None, timeout_s=1, max_retries=0, max_concurrency=1)
        await r.close()
        r._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        r.weights_pushed, r.servers[0].weight_version = True, "5"
        out, server = await r.post("/generate", {})
        assert len(out) == 2 and not server.stale and server.restarts == 0
        await r.close()

    asyncio.run(main())


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_server_answering_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    pm = make_plugin_manager()
    cfg = SGLangEngineConfig(urls=[url], startup_timeout_s=0)
    with pytest.raises(MilesError, match=f"no SGLang server answered.*{url}"):
        pm.create("engines", "sglang", cfg, spec=None, tokenizer=None, seed=0)


def test_sglang_outputs_become_completions():
    eng = SGLangEngine.__new__(SGLangEngine)  # parsing needs no connection
    eng.weight_version = 4
    out = {"text": "ab", "output_ids": [7, 8],
           "meta_info": {"finish_reason": {"type": "stop", "matched": 8}, "weight_version": "6",
                         "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None]]}}
    c = eng._completion(out)
    assert (c.token_ids, c.logprobs, c.finish_reason, c.weight_version) == ([7, 8], [-0.5, -1.25], "stop", 6)
    c = eng._completion({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"},
                                                         "weight_version": "default"}})
    assert (c.token_ids, c.finish_reason, c.weight_version) == ([], "abort", 4)


def test_weights_folder_is_the_kernel_disk_format(tmp_path):
    import torch

    named = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.arange(5, dtype=torch.bfloat16))]
    named.append(("tied.weight", named[0][1]))  # shares memory with a.weight
    write_version(str(tmp_path), named, 3)
    write_version(str(tmp_path), named, 3)  # a resumed run re-syncs a version: a new revision
    assert [n for _, _, n in W.committed(str(tmp_path))] == ["v00000003.r1"]  # older ones pruned
    back = dict(W.load_version(str(tmp_path), verify=True))
    assert list(back) == [n for n, _ in named]
    for name, t in named:
        assert torch.equal(back[name], t) and back[name].dtype == t.dtype
    assert json.loads((tmp_path / "v00000003.r1" / "manifest.json").read_text())["version"] == 3


def test_resumed_pieces_are_joined_with_their_weight_versions():
    c = Completion([7, 8], [-0.5, -1.0], "abort", 3, [3])
    _join(c, Completion([], [], "abort", 4, [4]))  # cut again before it ran: no tokens, no version
    _join(c, Completion([9], [-0.25], "stop", 4, [4]))
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([7, 8, 9], [-0.5, -1.0, -0.25], "stop")
    assert (c.weight_versions, c.weight_version) == ([3, 4], 3)  # as old as its oldest token
    queued = Completion([], [], "abort", 3, [3])  # aborted before it ran
    _join(queued, Completion([5], [-0.1], "length", 4, [4]))
    assert (queued.token_ids, queued.weight_versions, queued.weight_version) == ([5], [4], 4)


def test_pause_skips_an_unreachable_server():
    import httpx

    def answer(request):
        if request.url.host == "b":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"status": "ok", "mode": json.loads(request.content)["mode"]})

    async def main():
        r = Router(["http://a", "http://b"], api_key=None, timeout_s=1, max_retries=0, max_concurrency=2)
        await r.close()
        r._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        out = await r.broadcast("POST", "/pause_generation", [{"mode": "abort"}] * 2, r.servers, skip_down=True)
        assert out == [{"status": "ok", "mode": "abort"}, None] and not r.servers[1].healthy
        with pytest.raises(MilesError, match="failed on 1 of 2"):  # without skip_down: an error
            await r.broadcast("POST", "/pause_generation", [{"mode": "abort"}] * 2, r.servers)
        await r.close()

    asyncio.run(main())


def test_resumed_pieces_of_seeded_requests_get_distinct_seeds_every_round():
    """``seeded_requests``: an aborted completion resumes with a ``sampling_seed`` of its own (not
    none, not its prompt's, which its siblings share); another round gets another one."""
    from miles import SamplingParams

    eng = SGLangEngine.__new__(SGLangEngine)  # only _resume's own state (a unit test of it)
    eng._pauses, eng.weight_version, sent = 0, 0, []

    async def post(prompts, sampling):  # a server that cuts the first round short again
        sent.append(sampling)
        if len(sent) == 1:
            eng._pauses += 1
            return [{"meta_info": {"finish_reason": {"type": "abort"}}}] * len(prompts), 0
        out = {"meta_info": {"output_token_logprobs": [[-0.5, 4, ""]], "finish_reason": {"type": "length"}}}
        return [out] * len(prompts), eng._pauses

    eng._post = post
    cut = [Completion([1], [-0.1], "abort", 0, [0]) for _ in range(2)]  # two samples of one prompt
    pieces = [([5, 6], c, 11 * 1_000_003 + j * 1009) for j, c in enumerate(cut)]
    asyncio.run(eng._resume(pieces, SamplingParams(1.0, 1.0, 0, 3, [], seed=11)))
    seeds = [[s["sampling_seed"] for s in round_] for round_ in sent]
    assert len(sent) == 2 and all(len(set(r)) == 2 for r in seeds)  # the siblings differ
    assert set(seeds[0]).isdisjoint(seeds[1]) and 11 not in seeds[0] + seeds[1]
    assert [c.token_ids for c in cut] == [[1, 4], [1, 4]] and sent[1][0]["max_new_tokens"] == 2


MILES_METRICS = """# HELP miles_engine_running_sequences sequences (samples) decoding now
# TYPE miles_engine_running_sequences gauge
miles_engine_running_sequences 3.0
miles_engine_queued_sequences 5.0
miles_engine_kv_cache_usage 0.25
# TYPE miles_engine_generated_tokens counter
miles_engine_generated_tokens_total 120.0
"""
SGLANG_METRICS = """sglang:num_running_reqs{model_name="m",tp_rank="0"} 2.0
sglang:num_running_reqs{model_name="m",tp_rank="1"} 1.0
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 4.0
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
sglang:generation_tokens_total{model_name="m"} 42.0
sglang:spec_accept_rate{model_name="m"} 0.0
sglang:spec_accept_length{model_name="m"} 0.0
"""


def test_engine_stats_read_each_servers_metrics_and_keep_the_last_good_reading(monkeypatch):
    """``engine_stats()``: one reading per server from its /metrics (`miles serve`'s names and
    SGLang's); a server that fails keeps its last reading, marked stale with why; a slow one
    does not hold the caller past the timeout."""
    import threading
    import time

    import httpx
    from miles.protocols import EngineStats
    from miles_plugin_sglang import stats as stats_mod

    assert issubclass(SGLangEngine, EngineStats)
    monkeypatch.setattr(stats_mod, "TIMEOUT_S", 0.3)
    answers = {"a": MILES_METRICS, "b": SGLANG_METRICS}

    async def answer(request):
        body = answers[request.url.host]
        if body == "refused":
            raise httpx.ConnectError("refused")
        if body == "slow":
            await asyncio.sleep(0.8)
            return httpx.Response(200, text=MILES_METRICS.replace("3.0", "7.0"))
        return httpx.Response(404, text="no") if body == "missing" else httpx.Response(200, text=body)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def make():
        r = Router(["http://a", "http://b"], api_key=None, timeout_s=1, max_retries=1, max_concurrency=2)
        await r.close()
        r._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        return r

    try:
        router = asyncio.run_coroutine_threadsafe(make(), loop).result()
        stats = stats_mod.ServerStats(router, loop)
        a = {"name": "http://a", "running": 3.0, "queued": 5.0, "kv_cache_usage": 0.25, "generated_tokens": 120.0}
        b = {"name": "http://b", "running": 3.0, "queued": 4.0, "kv_cache_usage": 0.5, "generated_tokens": 42.0}
        assert stats.read() == [a, b]  # SGLang's labelled samples summed; its zero acceptance left out
        answers.update(a="refused", b="missing")
        gone = stats.read()
        assert gone[0] == {**a, "stale": True, "error": "ConnectError: refused"}
        assert gone[1]["stale"] and gone[1]["generated_tokens"] == 42.0 and "--enable-metrics" in gone[1]["error"]
        router.servers[1].healthy = False  # down for the router: not scraped, its last reading kept
        answers.update(a="slow", b=SGLANG_METRICS)
        t = time.monotonic()
        assert stats.read()[0]["generated_tokens"] == 120.0 and time.monotonic() - t < 0.7
        stats._fetch.result(timeout=5)  # the slow answer lands meanwhile: the next reading has it
        now = stats.read()
        assert now[0] == {**a, "running": 7.0} and now[1]["stale"] and now[1]["error"].startswith("ConnectionError")
        stats._fetch.result(timeout=5)
        asyncio.run_coroutine_threadsafe(router.close(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
