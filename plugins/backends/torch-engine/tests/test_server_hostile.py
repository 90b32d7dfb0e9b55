"""The cases of an outside probe that froze ``miles serve`` or answered 500, in process: each test
reproduces one (a hostile template, a huge prompt, a huge sample count, a dead group address, a
stalled body, out-of-range numbers, garbage p2p commits) and checks the bound that now holds."""
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from miles import MilesError, SamplingParams
from miles.testing import char_tokenizer

from miles_plugin_torch_engine.guard import Guard, check_api_key
from miles_plugin_torch_engine.limits import server_settings
from miles_plugin_torch_engine.scheduler import Item, Request, Scheduler, fair_shares
from miles_plugin_torch_engine.server import build_app

LOOPS = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"  # 10^8 steps


@pytest.fixture
def serve(engine):
    made = []

    def make(**kw):
        sched = Scheduler(engine)
        app = build_app(engine, sched, model_dir="mem", **kw)
        made.append((app, sched))
        return app

    yield make
    for app, sched in made:
        sched.stop()
        app.state.templates.close()
        app.state.prep.close()


def client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60)


async def health_gaps(app, task: asyncio.Task, every: float = 0.05) -> float:
    """The longest /health answer while ``task`` runs (the event loop's responsiveness)."""
    worst = 0.0
    async with client(app) as c:
        while not task.done():
            t0 = time.monotonic()
            assert (await c.get("/health")).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            await asyncio.sleep(every)
    return worst


def chat(template: str | None = None, **kw) -> dict:
    body = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2, **kw}
    if template is not None:
        body["chat_template_kwargs"] = {"chat_template": template}
    return body


def test_client_chat_templates_are_refused_by_default(serve):
    app = serve()

    async def main():
        async with client(app) as c:
            return [await c.post("/v1/chat/completions", json=chat(LOOPS)),
                    await c.post("/v1/chat/completions", json={**chat(), "chat_template": LOOPS})]

    for r in asyncio.run(main()):
        assert r.status_code == 400 and "trust_request_chat_template=true" in r.json()["error"]["message"]


def test_trusted_client_templates_render_within_their_budgets(serve):
    """The 103-byte nested-loop template is stopped at its time budget while /health keeps
    answering; a template allocating gigabytes hits its memory budget; a plain one works."""
    app = serve(trust_request_chat_template=True, template_timeout_s=2.0, template_memory_mb=256)
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"

    async def main():
        async with client(app) as c:
            t0 = time.monotonic()
            slow = asyncio.create_task(c.post("/v1/chat/completions", json=chat(LOOPS)))
            worst = await health_gaps(app, slow)
            slow, took = await slow, time.monotonic() - t0
            big = await c.post("/v1/chat/completions", json=chat("{{ 'x' * 2000000000 }}"))
            ok = await c.post("/v1/chat/completions", json=chat(plain, temperature=0))
            return slow, took, worst, big, ok

    slow, took, worst, big, ok = asyncio.run(main())
    assert slow.status_code == 400 and "longer than 2 s" in slow.json()["error"]["message"], slow.text
    assert took < 10 and worst < 0.5, (took, worst)
    assert big.status_code == 400 and "memory budget" in big.json()["error"]["message"], big.text
    assert ok.status_code == 200 and ok.json()["prompt_token_ids"] == list(
        char_tokenizer().encode("1+1=", add_special_tokens=False))


def test_a_huge_prompt_is_refused_and_a_large_one_tokenizes_off_the_loop(serve):
    app = serve(max_prompt_chars=600_000)
    huge = {"prompt": "1+1=" * (7 * 2**18), "max_tokens": 1}  # 7 MiB, as the probe sent
    large = {"prompt": "1+1=" * 2**17, "max_tokens": 1}  # 512 KiB: ~1.5 s in the tokenizer

    async def main():
        async with client(app) as c:
            first = await c.post("/v1/completions", json=huge)
            gen = await c.post("/generate", json={"text": huge["prompt"]})
            task = asyncio.create_task(c.post("/v1/completions", json=large))
            worst = await health_gaps(app, task)
            return first, gen, worst, await task

    first, gen, worst, large_r = asyncio.run(main())
    assert first.status_code == 413 and "max_prompt_chars" in first.json()["error"]["message"]
    assert gen.status_code == 413 and "max_prompt_chars" in gen.json()["error"]["message"]
    assert large_r.status_code == 400 and "context length" in large_r.json()["error"]["message"]
    assert worst < 0.5, worst


def test_one_samples_cap_for_both_apis(serve):
    app = serve()

    async def main():
        async with client(app) as c:
            v1 = await c.post("/v1/completions", json={"prompt": ["1+1="] * 1024, "n": 128, "max_tokens": 1})
            gen = await c.post("/generate", json={"text": ["1+1="] * 1024,
                                                  "sampling_params": {"n": 128, "max_new_tokens": 1}})
            return v1, gen

    for r in asyncio.run(main()):
        assert r.status_code == 400 and "max_samples_per_request" in r.text, r.text


def test_fair_shares():
    assert fair_shares([4096, 1], 64) == [63, 1]
    assert fair_shares([100, 100, 3], 64) == [30, 31, 3]
    assert fair_shares([1, 1, 1], 2) == [1, 1, 0]


def test_a_small_request_does_not_wait_behind_a_huge_one(engine):
    """A 2048-sample request runs in batches of ``admit_samples``; a 1-sample request that comes
    while it runs is answered after at most one more batch, long before the huge one ends."""
    sched = Scheduler(engine, admit_samples=256)
    done: list[str] = []
    params = SamplingParams(temperature=1.0, max_new_tokens=16)

    async def main():
        loop = asyncio.get_running_loop()

        def request(rid, n):
            r = Request(rid=rid, loop=loop, future=loop.create_future(), items=[Item((2, 5), params, n)])
            r.future.add_done_callback(lambda _: done.append(rid))
            return r

        big = request("big", 2048)
        sched.submit(big)
        while sched.stats["num_batches"] < 1:
            await asyncio.sleep(0.005)
        small = request("small", 1)
        sched.submit(small)
        await asyncio.gather(big.future, small.future)
        return big, small, sched.stats["num_batches"]

    big, small, batches = asyncio.run(main())
    sched.stop()
    assert done == ["small", "big"] and batches >= 8
    assert len(big.items[0].completions) == 2048 and len(small.items[0].completions) == 1


def test_a_seeded_request_is_admitted_whole(engine):
    """Splitting would draw a seeded request's samples from several fresh generators."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)

    def run(admit):
        sched = Scheduler(engine, admit_samples=admit)

        async def main():
            loop = asyncio.get_running_loop()
            r = Request(rid="s", loop=loop, future=loop.create_future(), seeded=True,
                        items=[Item((2, 5), params, 40), Item((2, 6), params, 40)])
            sched.submit(r)
            await r.future
            return [c.token_ids for item in r.items for c in item.completions], sched.stats["num_batches"]

        try:
            return asyncio.run(main())
        finally:
            sched.stop()

    (split, batches), (whole, _) = run(8), run(1024)
    assert split == whole and batches == 1


def test_large_bodies_are_prepared_off_the_loop_within_a_memory_bound():
    from miles_plugin_torch_engine.limits import Prep, ServerBusy

    prep, release = Prep(max_queued_mb=1.0), threading.Event()

    async def main():
        first = asyncio.create_task(prep.run(600_000, lambda: release.wait(10) and "first"))
        await asyncio.sleep(0.05)
        with pytest.raises(ServerBusy):
            await prep.run(600_000, lambda: "second")
        small = await prep.run(100, lambda: threading.current_thread().name)  # inline, not queued
        release.set()
        return await first, small

    assert asyncio.run(main()) == ("first", threading.main_thread().name)
    prep.close()


def test_group_joins_to_a_dead_address_are_bounded(serve):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    app = serve(group_connect_timeout_s=1.5)
    join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo"}

    async def main():
        async with client(app) as c:
            t0 = time.monotonic()
            first = asyncio.create_task(c.post("/init_weights_update_group", json=join))
            await asyncio.sleep(0.2)
            second = await c.post("/init_weights_update_group", json=join)  # while the first waits
            bad = await c.post("/init_weights_update_group", json={**join, "master_port": 10**6})
            return await first, time.monotonic() - t0, second, bad

    first, took, second, bad = asyncio.run(main())
    assert first.status_code == 400 and "no weights-update store" in first.json()["message"] and took < 5
    assert second.status_code == 409 and "still running" in second.json()["message"]
    assert bad.status_code == 400 and "master_port" in bad.json()["message"]
    joins = [t for t in threading.enumerate() if t.name == "miles-group-join"]
    for t in joins:  # the answer is set from inside the thread, which then unwinds: it must end
        t.join(5)
    assert not [t for t in joins if t.is_alive()]


def test_the_key_is_checked_before_the_body_and_a_stalled_body_times_out():
    async def route(scope, receive, send):
        raise AssertionError("the route must not run")

    async def stalled():  # the client sends headers, then nothing
        await asyncio.sleep(3600)

    async def call(guard, headers):
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/generate",
                 "headers": [(b"content-length", b"1000"), *headers]}
        t0 = time.monotonic()
        await guard(scope, stalled, send)
        return sent[0]["status"], json.loads(sent[1]["body"]), time.monotonic() - t0

    keyed = Guard(route, max_body_bytes=2**20, api_key="k3y", body_timeout_s=0.5)
    status, body, took = asyncio.run(call(keyed, []))
    assert status == 401 and took < 0.1
    status, body, took = asyncio.run(call(keyed, [(b"authorization", b"Bearer k3y")]))
    assert status == 408 and "body_timeout_s" in body["error"]["message"] and 0.4 < took < 2


def test_out_of_range_numbers_are_400s(serve):
    app = serve()
    cases = [("/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "stop_token_ids": [1e30]}, "stop_token_ids"),
             ("/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "stop_token_ids": [10**6]}, "vocabulary"),
             ("/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "seed": 2**70}, "seed"),
             ("/v1/chat/completions", {**chat(), "seed": -(2**70)}, "seed"),
             ("/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "top_k": 2**70}, "top_k"),
             ("/generate", {"text": "1+1=", "sampling_params": {"stop_token_ids": [1e30]}}, "stop_token_ids"),
             ("/generate", {"text": "1+1=", "sampling_params": {"stop_token_ids": [10**6]}}, "vocabulary"),
             ("/generate", {"text": "1+1=", "sampling_params": {"top_k": 2**70}}, "top_k")]

    async def main():
        async with client(app) as c:
            out = [await c.post(path, json=body) for path, body, _ in cases]
            return out, await c.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 2, "seed": -5})

    out, negative_seed = asyncio.run(main())
    for (path, body, word), r in zip(cases, out):
        assert r.status_code == 400 and word in r.text, (path, body, r.text[:300])
    assert negative_seed.status_code == 200


def test_p2p_routes_refuse_garbage(serve, engine):
    app = serve()
    bodies = [("/p2p/commit", {}), ("/p2p/commit", {"weight_version": "garbage"}),
              ("/p2p/commit", {"sessions": "abc"}), ("/p2p/commit", {"sessions": [1, 2]}),
              ("/p2p/open", {"tensors": "x"}), ("/p2p/open", {"tensors": [{"name": "w"}]}),
              ("/p2p/open", {"tensors": [{"name": "w", "dtype": "nope", "shape": [2]}]})]

    async def main():
        async with client(app) as c:
            out = [await c.post(path, json=body) for path, body in bodies]
            return out, await c.post("/p2p/commit", json={"weight_version": 3, "sessions": ["other"]})

    out, other = asyncio.run(main())
    for (path, body), r in zip(bodies, out):
        assert r.status_code == 400 and r.json()["success"] is False, (path, body, r.text)
    assert other.status_code == 200 and other.json()["committed"] is False  # another engine's sync
    assert engine.p2p_state() is engine.p2p_state() and "_p2p_state" not in vars(engine)


def test_blank_or_unsendable_api_keys_and_bad_settings_are_refused_at_start():
    for key in (" ", "", "two words", " padded ", "k\u00e9y"):
        with pytest.raises(MilesError, match="--api-key"):
            check_api_key(key)
    check_api_key("s3cret-KEY_1")
    with pytest.raises(MilesError, match="max_prompt_chars='lots'"):
        server_settings({"max_prompt_chars": "lots"})
    with pytest.raises(MilesError, match="weights_dir"):
        server_settings({"weights_dir": "/does/not/exist"})
    settings = {"max_samples_per_request": "64", "dtype": "float32"}
    assert server_settings(settings) == {"max_samples_per_request": 64} and settings == {"dtype": "float32"}
