"""End to end: real ``miles serve`` processes (torch engine behind SGLang's HTTP API) driven over
HTTP and through the ``sglang`` engine plugin (router, retries, weight updates, kill -9)."""
import concurrent.futures as cf
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from miles import SamplingParams, make_plugin_manager
import miles_wire as W
from miles.testing import TinySpec, char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-123"
# engine settings for the servers, e.g. "device=cuda" to run this file on a GPU machine
SETTINGS = os.environ.get("MILES_TEST_SERVE_SETTINGS", "").split()
DTYPE = getattr(torch, dict(kv.split("=", 1) for kv in SETTINGS).get("dtype", "float32"))


def engine_checksums(named):
    """What the servers hold after loading ``named``: the tensors cast to their dtype."""
    return {n: W.checksum(t.to(DTYPE)) for n, t in named}
AUTH = {"Authorization": f"Bearer {KEY}"}


def lively(model, seed):
    """Large random weights: the default init makes a tiny model repeat one token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5 * (1 if "embed" in name else 3))
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Hugging Face folder as `miles export` writes it: config, safetensors, tokenizer."""
    folder = tmp_path_factory.mktemp("export") / "model"
    tok = char_tokenizer()
    lively(TinySpec().build_model(tok), 0).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class Served:
    def __init__(self, proc, port, log):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"


def start(model_dir, log: Path, *args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "miles.cli", "serve", str(model_dir), "--port", "0", *args, *SETTINGS]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)


def wait_listening(proc: subprocess.Popen, log: Path, timeout: float = 120) -> int:
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert line and "miles serve: listening on http://" in line[0], \
        f"no listening line (got {line}); stderr:\n{log.read_text()[-3000:]}"
    return int(line[0].strip().rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """Two servers: loopback with a key, and all interfaces (which requires the key)."""
    logs = tmp_path_factory.mktemp("logs")
    procs = [start(model_dir, logs / "a.log", "--api-key", KEY),
             start(model_dir, logs / "b.log", "--host", "0.0.0.0", "--api-key", KEY)]
    try:
        ports = [wait_listening(p, logs / n) for p, n in zip(procs, ("a.log", "b.log"))]
        yield [Served(p, port, logs / n) for p, port, n in zip(procs, ports, ("a.log", "b.log"))]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
        for p in procs:  # nothing left behind
            assert p.poll() is not None
            assert not Path(f"/proc/{p.pid}").exists() or "zombie" in Path(f"/proc/{p.pid}/status").read_text()


def post(server, path, body=None, timeout=60):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=timeout)


def info(server):
    return httpx.get(server.url + "/get_server_info", headers=AUTH, timeout=10).json()


def test_public_bind_needs_an_api_key(model_dir):
    r = subprocess.run([sys.executable, "-m", "miles.cli", "serve", str(model_dir), "--host", "0.0.0.0",
                        "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--api-key" in r.stderr, r.stderr


def test_every_request_needs_the_key(servers):
    for s in servers:
        for path in ("/health", "/get_model_info"):
            assert httpx.get(s.url + path, timeout=10).status_code == 401
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
            assert httpx.get(s.url + path, headers=AUTH, timeout=10).status_code == 200
        assert httpx.post(s.url + "/generate", json={"input_ids": [2, 5]}, timeout=10).status_code == 401


def local_logprobs(model_dir, prompt, tokens, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_generate_is_sglang_shaped_with_exact_logprobs(servers, model_dir):
    s = servers[0]
    prompt = [2, 5, 6, 7, 8]
    for temperature in (1.0, 0.7):
        r = post(s, "/generate", {"input_ids": prompt, "rid": f"t{temperature}", "return_logprob": True,
                                  "sampling_params": {"temperature": temperature, "max_new_tokens": 12,
                                                      "sampling_seed": 1}})
        assert r.status_code == 200, r.text
        out = r.json()
        meta = out["meta_info"]
        assert set(out) == {"text", "output_ids", "meta_info"} and isinstance(out["text"], str)
        assert meta["id"] == f"t{temperature}" and meta["prompt_tokens"] == len(prompt)
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert meta["completion_tokens"] == len(out["output_ids"]) > 0
        assert meta["weight_version"] == 0
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == out["output_ids"] and all(t[2] is None for t in triples)
        want = local_logprobs(model_dir, prompt, out["output_ids"], temperature)
        assert torch.allclose(torch.tensor([t[0] for t in triples]), want, atol=1e-4)
    # a batch with parallel samples: SGLang's order is every prompt's 1st sample, then the 2nd
    r = post(s, "/generate", {"input_ids": [[2, 5], [2, 6, 7]], "sampling_params": {"n": 2, "max_new_tokens": 4}})
    assert [o["meta_info"]["prompt_tokens"] for o in r.json()] == [2, 3, 2, 3]
    bad = post(s, "/generate", {"input_ids": [2, 5], "sampling_params": {"min_p": 0.5}})
    assert bad.status_code == 400 and "min_p" in bad.json()["error"]["message"]


def fire(server, bodies):
    pool = cf.ThreadPoolExecutor(len(bodies))
    return pool, [pool.submit(post, server, "/generate", b) for b in bodies]


def wait_waiting(server, n, timeout=30):
    deadline = time.time() + timeout
    while info(server)["num_waiting"] < n:
        assert time.time() < deadline, info(server)
        time.sleep(0.05)


def test_concurrent_requests_run_as_one_batch_after_pause(servers):
    s = servers[0]
    assert post(s, "/pause_generation").json()["status"] == "ok"
    before = info(s)
    bodies = [{"input_ids": [2, 5 + i % 3], "sampling_params": {"n": 2, "max_new_tokens": 6}} for i in range(6)]
    pool, futures = fire(s, bodies)
    wait_waiting(s, 6)
    time.sleep(0.3)  # paused: nothing runs however long we wait
    assert info(s)["num_batches"] == before["num_batches"] and not any(f.done() for f in futures)
    assert httpx.get(s.url + "/health_generate", headers=AUTH, timeout=30).status_code == 200  # still healthy
    post(s, "/continue_generation")
    outs = [f.result().json() for f in futures]
    pool.shutdown()
    after = info(s)
    assert all(len(o) == 2 and o[0]["meta_info"]["finish_reason"]["type"] != "abort" for o in outs)
    assert after["num_requests"] - before["num_requests"] == 6
    # six requests, one batch, and one engine call (identical prompts merged, prefill shared)
    assert after["num_batches"] - before["num_batches"] == 1
    assert after["num_engine_calls"] - before["num_engine_calls"] == 1


def test_abort_a_queued_request(servers):
    s = servers[0]
    post(s, "/pause_generation")
    pool, futures = fire(s, [{"input_ids": [2, 9], "rid": rid, "sampling_params": {"max_new_tokens": 4}}
                             for rid in ("keep", "victim")])
    wait_waiting(s, 2)
    assert post(s, "/abort_request", {"rid": "victim"}).status_code == 200
    victim = futures[1].result().json()
    assert victim["meta_info"]["finish_reason"]["type"] == "abort" and victim["output_ids"] == []
    assert not futures[0].done()
    post(s, "/continue_generation")
    assert futures[0].result().json()["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    pool.shutdown()


def seq_logprobs(model, prompt, tokens):
    """Log-probs (temperature 1) of ``tokens`` after ``prompt``: one forward, no cache."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def _pause_abort_resume(model_dir, tmp_path, new, prompts):
    """One batch through the sglang engine with ``in_flight: resume``: an aborting pause while the
    batch decodes on a fresh server, ``new`` loaded as version 1, continue; the groups.

    The server takes the whole request into one engine call (``admit_samples``) but decodes 2 rows
    at a time, so the 32 samples run in turns, and the pause is sent once the server reports rows
    decoding with more waiting: most of the batch is then left to run, a window wide enough for a
    loaded machine (all 32 rows at once end within a few of the test's polls)."""
    tmp_path.mkdir()
    log = tmp_path / "serve.log"
    proc = start(model_dir, log, "max_batch_size=2", "admit_samples=32")
    pool = cf.ThreadPoolExecutor(1)
    try:
        server = Served(proc, wait_listening(proc, log), log)
        pm = make_plugin_manager()
        cfg = pm.registry("engines")["sglang"].config(urls=[server.url], weights_dir=str(tmp_path / "w"))
        engine = pm.create("engines", "sglang", cfg, spec=None, tokenizer=None, seed=0)
        try:
            future = pool.submit(engine.generate, prompts, SamplingParams(max_new_tokens=120), 4)
            deadline = time.time() + 60
            while True:  # the server's own reading (/metrics): rows decoding, more waiting for a row
                load = engine.engine_stats()[0]
                if load["running"] > 0 and load["queued"] > 0 and load["generated_tokens"] > 0:
                    break
                assert time.time() < deadline and not future.done(), load
                time.sleep(0.002)
            engine.pause_generation(mode="abort")
            engine.load_weights([(n, p.detach()) for n, p in new.named_parameters()], 1)
            engine.continue_generation()
            groups = future.result(timeout=120)
        finally:
            engine.close()
        assert post(server, "/pause_generation", {"mode": "retract"}).status_code == 400
        return groups
    finally:
        pool.shutdown()
        proc.kill()
        proc.wait(30)


def test_pause_abort_then_resume_joins_old_and_new_weights(model_dir, tmp_path):
    """``rollout.in_flight: resume`` at the client: an aborting pause in the middle of a batch, new
    weights, continue. Every sample finishes; a cut one is the old weights' prefix joined to what
    the new weights generated after prompt + prefix, and records both versions.

    The pause is sent while the server still has groups of the batch waiting (``_pause_abort_resume``),
    so samples are cut however loaded the machine; should a run still end with none cut, the
    scenario runs again on a fresh server (every sample of every run is checked)."""
    from transformers import AutoModelForCausalLM

    new = lively(TinySpec().build_model(char_tokenizer()), 7)
    old = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [[2, 5 + i] for i in range(8)]
    atol = 1e-4 if DTYPE == torch.float32 else 5e-2
    seen = []
    for attempt in range(4):
        groups = _pause_abort_resume(model_dir, tmp_path / str(attempt), new, prompts)
        cut = 0
        for prompt, group in zip(prompts, groups):
            for c in group:
                assert c.finish_reason in ("stop", "length") and len(c.token_ids) == len(c.logprobs) <= 120
                assert c.weight_versions in ([0], [1], [0, 1]) and c.weight_version == c.weight_versions[0]
                lp = torch.tensor(c.logprobs)
                on_old = torch.isclose(lp, seq_logprobs(old, prompt, c.token_ids), atol=atol, rtol=0)
                on_new = torch.isclose(lp, seq_logprobs(new, prompt, c.token_ids), atol=atol, rtol=0)
                if c.weight_versions != [0, 1]:
                    assert (on_old if c.weight_versions == [0] else on_new).all()
                    continue
                cut += 1
                k = int((~on_old).nonzero()[0])  # the first token the old weights did not generate
                assert 0 < k < len(c.token_ids) and on_new[k:].all()
        seen.append(sorted(str(c.weight_versions) for g in groups for c in g))
        if cut:
            return
    raise AssertionError(f"no sample was cut by the pause in {len(seen)} runs; versions: {seen}")


def test_sglang_plugin_routes_updates_weights_and_survives_kill_9(servers, model_dir, tmp_path):
    pm = make_plugin_manager()
    comp = pm.registry("engines")["sglang"]
    cfg = comp.config(urls=[s.url for s in servers], api_key=KEY, weights_dir=str(tmp_path / "w"),
                      health_check_interval_s=0.5)
    engine = pm.create("engines", "sglang", cfg, spec=None, tokenizer=None, seed=0)
    try:
        params = SamplingParams(max_new_tokens=6)
        loads = engine.engine_stats()
        outs = engine.generate([[2, 5 + i] for i in range(8)], params, n=3)
        assert [len(o) for o in outs] == [3] * 8
        for c in (c for o in outs for c in o):
            assert len(c.token_ids) == len(c.logprobs) and all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
        # the servers' load from their /metrics (EngineStats): the tokens generated are those returned
        after = engine.engine_stats()
        assert [r["name"] for r in after] == [s.url for s in servers]
        for r in after:
            assert r["running"] == r["queued"] == 0 and 0 <= r["kv_cache_usage"] <= 1 and "stale" not in r
        grown = sum(r["generated_tokens"] for r in after) - sum(r["generated_tokens"] for r in loads)
        assert grown == sum(len(c.token_ids) for o in outs for c in o)
        served = {u: st["served"] for u, st in engine.server_stats().items()}
        assert all(n > 0 for n in served.values()), served  # least-outstanding routing spread the load
        # new weights to both servers, checked by version and checksums
        new = lively(TinySpec().build_model(char_tokenizer()), 7)
        named = [(n, p.detach()) for n, p in new.named_parameters()]
        engine.load_weights(named, 5)
        for s in servers:
            assert httpx.get(s.url + "/get_weight_version", headers=AUTH, timeout=10).json()["weight_version"] == 5
        want = engine_checksums(named)
        assert engine.weight_checksums(list(want)) == want
        assert {c.weight_version for o in engine.generate([[2, 5]], params, n=2) for c in o} == {5}
        # and by torch.distributed broadcast (gloo): the collective HTTP calls, one rank per server
        newer = [(n, p.detach()) for n, p in lively(TinySpec().build_model(char_tokenizer()), 8).named_parameters()]
        trainer = type("Trainer", (), {"rank": 0, "named_weights": lambda self: iter(newer)})()
        # verify: the transport compares the servers' checksums with the trainer's (same dtype only)
        verify = DTYPE == torch.float32
        sync = pm.create("transports", "broadcast", pm.registry("transports")["broadcast"].config(verify=verify))
        assert engine.num_weight_ranks == 2
        assert sync.sync(trainer, [engine], 6)["weight_sync_bytes"] > 0
        want = engine_checksums(newer)
        assert engine.weight_checksums(list(want)) == want
        assert {c.weight_version for o in engine.generate([[2, 5]], params, n=2) for c in o} == {6}
        # kill -9 one server: every request still completes, on the survivor
        victim, survivor = servers[1], servers[0]
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        before = engine.server_stats()[survivor.url]["served"]
        outs = engine.generate([[2, 5 + i] for i in range(8)], params, n=2)
        assert [len(o) for o in outs] == [2] * 8
        # the call is split into one batched request per server the client still thinks routable
        # (2, or 1 if a health check already saw the kill): the survivor answers all of them
        assert engine.server_stats()[survivor.url]["served"] - before in (1, 2)
        assert engine.health() == {survivor.url: True, victim.url: False}
        t = time.monotonic()
        dead = engine.engine_stats()[1]  # never raises: the killed server's last reading, marked stale
        assert time.monotonic() - t < 3 and dead["stale"] and dead["generated_tokens"] == after[1]["generated_tokens"]
        # a weight update now reaches the survivor; the dead server misses it, no error, and stays
        # out of rotation (stale) until it is back and re-synced
        engine.load_weights(named, 7)
        assert httpx.get(survivor.url + "/get_weight_version", headers=AUTH, timeout=10).json()["weight_version"] == 7
        assert engine.server_stats()[victim.url]["stale"] and not engine.server_stats()[survivor.url]["stale"]
        want = engine_checksums(named)
        assert engine.weight_checksums(list(want)) == want
        assert engine.servers_down() == [victim.url]
    finally:
        engine.close()


def test_a_restart_between_two_requests_is_noticed_and_resynced(model_dir, tmp_path):
    """kill -9, then the server is back on its port before the client sent anything: no request
    failed and no health check ran, but its first answer reports its boot weights' version. The
    client drops that answer and raises EngineRestarted (the loop then pushes the weights again)."""
    from miles import EngineRestarted

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    def boot(name):  # the last --port wins over start()'s --port 0
        proc = start(model_dir, tmp_path / name, "--port", str(port))
        wait_listening(proc, tmp_path / name)
        return proc

    procs = [boot("first.log")]
    pm = make_plugin_manager()
    cfg = pm.registry("engines")["sglang"].config(urls=[f"http://127.0.0.1:{port}"], weights_dir=str(tmp_path / "w"),
                                                   health_check_interval_s=3600, restart_wait_s=0)
    engine = pm.create("engines", "sglang", cfg, spec=None, tokenizer=None, seed=0)
    named = [(n, p.detach()) for n, p in lively(TinySpec().build_model(char_tokenizer()), 7).named_parameters()]
    params = SamplingParams(max_new_tokens=4)
    try:
        engine.load_weights(named, 3)
        assert {c.weight_version for o in engine.generate([[2, 5]], params, n=2) for c in o} == {3}
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        procs.append(boot("second.log"))
        with pytest.raises(EngineRestarted, match="restarted without the current weights"):
            engine.generate([[2, 5]], params, n=2)
        assert engine.restarts == 1
        engine.load_weights(named, 3)  # what the loop does on EngineRestarted
        assert {c.weight_version for o in engine.generate([[2, 5]], params, n=2) for c in o} == {3}
    finally:
        engine.close()
        for p in procs:
            p.kill()
            p.wait(30)


def test_sigterm_shuts_down_cleanly_and_frees_the_port(servers):
    s = servers[0]
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0, s.log.read_text()[-2000:]
    from miles_procs import port_free

    assert port_free("127.0.0.1", s.port)  # a server could bind it again (TIME_WAIT left by clients counts as free)
    assert time.time() - t0 < 30
