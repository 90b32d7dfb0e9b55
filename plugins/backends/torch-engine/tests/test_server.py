"""``miles serve``'s app and scheduler in process (the subprocess end-to-end tests are in
tests/test_serve.py): request validation, batching/merging, weight endpoints, non-blocking jobs."""
import asyncio
import threading

import httpx
import pytest
import torch
from miles.testing import TinySpec, char_tokenizer, listening_port

from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine
from miles_plugin_torch_engine.scheduler import Scheduler
from miles_plugin_torch_engine.guard import check_bind
from miles_plugin_torch_engine.server import build_app


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class CountingEngine(TorchEngine):
    """The real engine, recording each generate call's (prompt count, n)."""

    calls: list

    def generate(self, prompts, params, n=1):
        self.calls.append((len(prompts), n))
        return super().generate(prompts, params, n)


@pytest.fixture
def engine():
    eng = CountingEngine(TorchEngineConfig(), spec=TinySpec(), tokenizer=char_tokenizer(), seed=0)
    eng.calls = []
    return eng


def serve_app(engine, **kw):
    scheduler = Scheduler(engine)
    return build_app(engine, scheduler, model_dir="mem", **kw), scheduler


async def call(app, method, path, **kw):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.request(method, path, **kw)


def run(coro):
    return asyncio.run(coro)


def test_bad_requests_name_the_field(engine):
    app, sched = serve_app(engine)
    cases = [({"input_ids": []}, "input_ids"), ({"input_ids": [2, 5], "sampling_params": {"top_q": 1}}, "top_q"),
             ({"input_ids": [2, 999]}, "vocabulary"), ({"input_ids": [2], "stream": True}, "stream"),
             ({"input_ids": [2], "sampling_params": {"stop": ["x"]}}, "stop_token_ids"),
             ({"text": "1", "input_ids": [2]}, "exactly one")]
    for body, word in cases:
        r = run(call(app, "POST", "/generate", json=body))
        assert r.status_code == 400 and word in r.json()["error"]["message"], (body, r.text)
    assert engine.calls == []
    sched.stop()


def test_identical_prompts_share_one_engine_call(engine):
    """Requests queued together run as one batch; identical prompts merge and counts that differ
    are met with one call at n = gcd."""
    app, sched = serve_app(engine)
    sched.pause()

    async def main():
        bodies = [{"input_ids": [2, 5], "sampling_params": {"n": 2, "max_new_tokens": 3}},
                  {"input_ids": [2, 5], "sampling_params": {"n": 4, "max_new_tokens": 3}},
                  {"input_ids": [[2, 6], [2, 7]], "sampling_params": {"n": 2, "max_new_tokens": 3}}]
        tasks = [asyncio.create_task(call(app, "POST", "/generate", json=b)) for b in bodies]
        while sched.num_waiting < 3:
            await asyncio.sleep(0.01)
        sched.resume()
        return [(await t).json() for t in tasks]

    a, b, c = run(main())
    assert (len(a), len(b), len(c)) == (2, 4, 4)
    # [2,5] wants 6 samples, [2,6] and [2,7] 2 each: gcd 2 -> [2,5] x3 + [2,6] + [2,7], n=2
    assert engine.calls == [(5, 2)]
    assert sched.stats["num_batches"] == 1 and sched.stats["num_requests"] == 3
    sched.stop()


def test_seeded_requests_are_reproducible(engine):
    app, sched = serve_app(engine)
    body = {"input_ids": [2, 5, 6], "sampling_params": {"max_new_tokens": 6, "sampling_seed": 3}}
    first, second = (run(call(app, "POST", "/generate", json=body)).json()["output_ids"] for _ in range(2))
    assert first == second
    sched.stop()


class BlockingEngine:
    """Stands in for an engine inside a collective: the weight call blocks until released."""

    weight_version = 0
    tokenizer = None

    class model:  # noqa: N801 - mimics engine.model.config
        class config:  # noqa: N801
            vocab_size = 10

    def __init__(self):
        self.release = threading.Event()

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name, backend="gloo"):
        assert self.release.wait(30)
        return None

    def weight_checksums(self, names=None):
        return {"w": "abc"}


def test_weight_calls_run_on_the_engine_thread_without_blocking_the_server():
    eng = BlockingEngine()
    app, sched = serve_app(eng)

    async def main():
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": "g", "backend": "gloo"}
        pending = asyncio.create_task(call(app, "POST", "/init_weights_update_group", json=body))
        await asyncio.sleep(0.2)
        health = await call(app, "GET", "/health")
        version = await call(app, "GET", "/get_weight_version")
        assert not pending.done()
        eng.release.set()
        return health, version, await pending

    with listening_port() as port:  # the trainer's store
        health, version, done = run(main())
    assert health.status_code == 200 and version.json() == {"weight_version": 0}
    assert done.json() == {"success": True, "message": "ok"}
    r = run(call(app, "POST", "/weights_checksum", json={"names": ["w"]}))
    assert r.json()["checksums"] == {"w": "abc"}
    # SGLang-only no-op fields are accepted, unknown ones are named
    r = run(call(app, "POST", "/weights_checksum", json={"names": None, "flush_cache": True}))
    assert r.status_code == 200
    r = run(call(app, "POST", "/weights_checksum", json={"nmes": ["w"]}))
    assert r.status_code == 400 and "nmes" in r.json()["message"]
    r = run(call(app, "POST", "/update_weights_from_disk", json={"model_path": "/x"}))
    assert r.status_code == 400 and r.json() == {"success": False,
                                                 "message": "engine does not support update_weights_from_disk"}
    sched.stop()


def test_engine_weight_errors_come_back_as_sglang_failures(engine):
    app, sched = serve_app(engine)
    r = run(call(app, "POST", "/update_weights_from_disk", json={"model_path": "/does/not/exist"}))
    assert r.status_code == 400 and r.json()["success"] is False and r.json()["message"]
    names = ["model.embed_tokens.weight"]
    r = run(call(app, "POST", "/weights_checksum", json={"names": names}))
    assert r.status_code == 200 and list(r.json()["checksums"]) == names
    sched.stop()


def test_api_key_and_bind_policy(engine):
    app, sched = serve_app(engine, api_key="k")
    assert run(call(app, "GET", "/health")).status_code == 401
    assert run(call(app, "GET", "/health", headers={"Authorization": "Bearer k"})).status_code == 200
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "k")
    with pytest.raises(Exception, match="--api-key"):
        check_bind("0.0.0.0", None)
    sched.stop()


def test_health_generate_runs_while_paused(engine):
    app, sched = serve_app(engine)
    sched.pause()
    assert run(call(app, "GET", "/health_generate")).status_code == 200
    assert engine.calls == [(1, 1)]
    sched.stop()
    assert run(call(app, "GET", "/health")).status_code == 503


def test_scheduler_answers_queued_requests_as_aborted_on_stop(engine):
    app, sched = serve_app(engine)
    sched.pause()

    async def main():
        t = asyncio.create_task(call(app, "POST", "/generate", json={"input_ids": [2, 5], "rid": "x"}))
        while sched.num_waiting < 1:
            await asyncio.sleep(0.01)
        sched.stop()
        return (await t).json()

    out = run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["id"] == "x"
    assert engine.calls == []


def test_requests_aborted_while_queued_report_the_engine_weight_version(engine):
    """An aborting pause answers queued requests at once; like SGLang's, each output carries the
    engine's weight version (a missing one reads as a restarted server to the sglang client)."""
    engine.weight_version = 7
    app, sched = serve_app(engine)
    sched.pause()

    async def main():
        t = asyncio.create_task(call(app, "POST", "/generate", json={"input_ids": [[2, 5], [2, 6]]}))
        while sched.num_waiting < 1:
            await asyncio.sleep(0.01)
        paused = await call(app, "POST", "/pause_generation", json={"mode": "abort"})
        return paused, (await t).json()

    paused, outs = run(main())
    assert paused.status_code == 200 and len(outs) == 2
    assert [(o["meta_info"]["finish_reason"]["type"], o["meta_info"]["weight_version"], o["output_ids"])
            for o in outs] == [("abort", 7, [])] * 2
    assert engine.calls == []
    sched.stop()


def test_accepted_connections_send_without_delay():
    """asyncio sets TCP_NODELAY only on sockets accepted from an IPPROTO_TCP listener; without
    it every answer written in two pieces waited ~40 ms for the client's delayed ACK."""
    import socket

    from miles_procs import listening_socket

    async def main() -> int:
        seen: list[int] = []

        async def handle(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = listening_socket("127.0.0.1", 0)
        sock.setblocking(False)
        server = await asyncio.start_server(handle, sock=sock)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        while not seen:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        return seen[0]

    assert asyncio.run(main()) != 0
