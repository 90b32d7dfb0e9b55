"""``miles serve`` under bad input, in process: every bad request answers a 4xx JSON error and the
server keeps serving; slow weight-group joins stay off the engine thread; payload limits hold."""
import asyncio
import json
import socket

import httpx
import pytest

from miles_plugin_torch_engine.scheduler import Scheduler
from miles_plugin_torch_engine.server import build_app

OK = {"input_ids": [2, 5], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def app_of(engine, **kw):
    sched = Scheduler(engine)
    return build_app(engine, sched, model_dir="mem", **kw), sched


async def send(app, method, path, **kw):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.request(method, path, **kw)


def test_bad_bodies_get_json_errors_and_the_server_keeps_serving(engine):
    app, sched = app_of(engine, max_body_mb=0.01)
    nested = ("[" * 5000) + ("]" * 5000)  # deeper than json.loads recurses
    cases = [
        (b"{not json", 400, None), (nested.encode(), 400, None), (b"x" * 20000, 413, "larger"),
        (json.dumps({**OK, "sampling_params": {"sampling_seed": 2**70}}), 400, "sampling_seed"),
        (json.dumps({"text": ""}), 400, "empty"), (json.dumps({"input_ids": "abc"}), 400, None),
        (json.dumps({"input_ids": [2, 5], "sampling_params": {"max_new_tokens": -3}}), 400, None),
        (json.dumps({"input_ids": [2] * 100, "sampling_params": {"max_new_tokens": 100}}), 400,
         "max_position_embeddings"),
        (json.dumps({"input_ids": [2], "sampling_params": {"n": 10**6}}), 400, "samples"),
        (json.dumps({"input_ids": [-1]}), 400, "vocabulary"), (json.dumps([1, 2]), 400, None)]

    async def main():
        out = [await send(app, "POST", "/generate", content=body) for body, _, _ in cases]
        many = await asyncio.gather(*(send(app, "POST", "/generate", json=OK) for _ in range(200)))
        return out, many, await send(app, "POST", "/generate", json=OK)

    out, many, final = asyncio.run(main())
    for (body, status, word), r in zip(cases, out):
        assert r.status_code == status, (str(body)[:80], r.text[:200])
        assert "message" in r.json()["error"] and (word is None or word in r.text), r.text[:200]
    assert all(r.status_code == 200 for r in many)
    assert final.status_code == 200 and len(final.json()["output_ids"]) == 2
    sched.stop()


def test_group_join_to_a_closed_port_does_not_stall_generation(engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    app, sched = app_of(engine, group_join_timeout_s=3.0, group_connect_timeout_s=1.0)
    join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo"}

    async def main():
        t = asyncio.create_task(send(app, "POST", "/init_weights_update_group", json=join))
        await asyncio.sleep(0.3)
        gen = await asyncio.wait_for(send(app, "POST", "/generate", json=OK), 2.5)  # while joining
        joined = await t
        return gen, joined, await send(app, "GET", "/health")

    gen, joined, health = asyncio.run(main())
    assert gen.status_code == 200
    assert joined.status_code == 400 and joined.json()["success"] is False
    assert health.json()["weights_update_group"]["state"] == "failed"
    sched.stop()


def test_weight_payload_limits(engine, tmp_path):
    app, sched = app_of(engine, weights_dirs=[str(tmp_path / "allowed")])
    shm = {"format": "miles-shm/1", "segment": "miles_abuse_test", "size": 10**12, "tensors": []}

    async def main():
        big = await send(app, "POST", "/update_weights_from_tensor",
                         json={"serialized_named_tensors": json.dumps(shm)})
        outside = await send(app, "POST", "/update_weights_from_disk", json={"model_path": str(tmp_path)})
        return big, outside

    big, outside = asyncio.run(main())
    assert big.status_code == 400 and "fit in" in big.json()["message"]
    assert outside.status_code == 400 and "outside" in outside.json()["message"]
    sched.stop()


def test_every_route_needs_the_key(engine):
    app, sched = app_of(engine, api_key="k3y")
    paths = sorted({(m, r.path) for r in app.routes for m in getattr(r, "methods", ())})

    async def main():
        return [(m, p, await send(app, m, p)) for m, p in paths]

    for m, p, r in asyncio.run(main()):
        assert r.status_code == 401, (m, p, r.status_code)
    sched.stop()


def test_kv_cache_does_not_stay_sized_to_one_long_request(engine, monkeypatch):
    """A long prompt then many short ones: the fast path's cache follows the request once it is
    large (KEEP_BYTES lowered so the tiny model counts as large)."""
    fwd = engine._fast.fwd
    monkeypatch.setattr(type(fwd), "KEEP_BYTES", 0)
    from miles import SamplingParams

    engine.generate([[2] * 100], SamplingParams(temperature=0, max_new_tokens=4))
    long_cache = fwd.k_cache.numel()
    engine.generate([[2, 5]] * 200, SamplingParams(temperature=0, max_new_tokens=4))
    assert fwd.max_len < 100 and fwd.k_cache.numel() < 2 * 200 * 16 * long_cache // (64 * 112)


def test_model_folder_without_tokenizer_files_is_refused(tmp_path):
    from miles import MilesError

    from miles_plugin_torch_engine.server import FolderSpec

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(MilesError, match="no tokenizer files"):
        FolderSpec(str(tmp_path)).build_tokenizer()

