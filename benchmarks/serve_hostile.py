"""A well-behaved client's latency against ``miles serve`` with and without a hostile client.

A real ``miles serve`` process (loopback, an API key, a tiny random Qwen2 unless ``--model``)
answers a well-behaved client's small ``/generate`` requests, one at a time, first alone
(baseline), then while hostile threads mix the requests an outside probe used to freeze the
server or make it answer 500: a client chat template of nested loops, a 7 MiB prompt,
``prompt: ["1+1="]*1024, n: 128``, the largest legal request (4,096 samples) again and again,
``/init_weights_update_group`` to a dead port, request bodies that stop half-way (with and
without the key), out-of-range ``stop_token_ids`` and seeds, garbage ``/p2p/commit``s. The
server's RSS is sampled throughout; at the end it gets SIGTERM while a group join and a
half-sent body are still in flight, and must exit 0 with no traceback.

    python benchmarks/serve_hostile.py [--quick] [--requests 60] [--seconds 30] [--json OUT]

The last line reads ``serve_hostile p99 with/without hostile client ratio R``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

KEY = "bench-key"
LOOPS = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
GOOD = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


def tiny_model(folder: Path, context: int = 512) -> Path:
    """A random two-layer Qwen2 over the character tokenizer of miles' tests."""
    import torch
    from miles.testing import char_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def start_server(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MILES_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(model), "--port", "0",
                             "body_timeout_s=2", "group_connect_timeout_s=2"],
                            env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(180)
    if not line or "listening on http://" not in line[0]:
        proc.kill()
        raise SystemExit(f"miles serve did not start:\n{log.read_text()[-3000:]}")
    return proc, line[0].strip().rsplit(" ", 1)[1]


def good_client(url: str, count: int, seconds: float = 0.0, until: threading.Event | None = None) -> list[float]:
    """Seconds per small request, in a row, at least ``count`` of them, for at least ``seconds``
    and until ``until`` is set or a minute more has passed (every one must succeed)."""
    out: list[float] = []
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        while (len(out) < count or time.monotonic() < deadline
               or (until is not None and not until.is_set() and time.monotonic() < deadline + 60)):
            t0 = time.perf_counter()
            r = c.post("/generate", json=GOOD)
            out.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise SystemExit(f"the well-behaved request failed: {r.status_code} {r.text[:300]}")
    return out


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hostile_requests() -> list[tuple[str, dict]]:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return [
        ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"chat_template": LOOPS}}),
        ("/v1/completions", {"prompt": "1+1=" * (7 * 2**18), "max_tokens": 1}),
        ("/v1/completions", {"prompt": ["1+1="] * 1024, "n": 128, "max_tokens": 4}),
        ("/generate", {"input_ids": [[5, 6, 7]] * 64, "sampling_params": {"n": 64, "max_new_tokens": 16}}),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": dead_port(),
                                        "rank_offset": 1, "world_size": 2, "group_name": "x", "backend": "gloo"}),
        ("/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "stop_token_ids": [1e30]}),
        ("/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "seed": 2**70}),
        ("/p2p/commit", {"weight_version": "garbage", "sessions": "x"}),
    ]


def half_body(url: str, keyed: bool) -> int:
    """Headers promising 100 kB, 10 bytes of body, then silence: the status the server answers."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    auth = f"Authorization: Bearer {KEY}\r\n" if keyed else ""
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
                  f"Content-Length: 100000\r\n\r\n{{\"text\": \"".encode())
        reply = s.recv(4096).decode(errors="replace")
    return int(reply.split(" ", 2)[1]) if reply.startswith("HTTP/") else 0


def in_flight_at_exit(url: str) -> list[threading.Thread]:
    """A group join to a dead port and a half-sent body, still waiting when SIGTERM comes."""
    path, body = hostile_requests()[4]

    def join() -> None:
        try:
            httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        except httpx.HTTPError:
            pass  # the server went away: what matters is how it went

    threads = [threading.Thread(target=join, daemon=True),
               threading.Thread(target=half_body, args=(url, True), daemon=True)]
    for t in threads:
        t.start()
    return threads


def hostile_client(url: str, stop: threading.Event, statuses: Counter, turns: Iterator[int],
                   answered: set[int], covered: threading.Event) -> None:
    """Hostile requests of every kind in turn (``turns`` is shared by the threads, so the first
    round covers every kind however slowly each is answered) until ``stop``; ``covered`` is set
    once every kind has had its answer."""
    cases = hostile_requests()
    kinds = len(cases) + 2
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        while not stop.is_set():
            kind = next(turns) % kinds
            if kind < len(cases):
                path, body = cases[kind]
                statuses[f"{path} {c.post(path, json=body).status_code}"] += 1
            else:
                keyed = kind == len(cases)
                statuses[f"half body{' (keyed)' if keyed else ''} {half_body(url, keyed)}"] += 1
            answered.add(kind)
            if len(answered) == kinds:
                covered.set()


def rss_sampler(pid: int, stop: threading.Event, out: list[float]) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        try:
            out.append(sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20)
        except psutil.Error:
            return
        time.sleep(0.1)


def percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short smoke run (5 requests a phase, "
                    "a 1.5 s hostile phase)")
    ap.add_argument("--requests", type=int, default=60, help="well-behaved requests per phase (at least)")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of the hostile phase (at least)")
    ap.add_argument("--hostile-threads", type=int, default=3)
    ap.add_argument("--model", default=None, help="a model folder (default: a tiny random Qwen2)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    count, seconds = (5, 1.5) if args.quick else (args.requests, args.seconds)
    work = Path(tempfile.mkdtemp(prefix="serve-hostile-"))
    model = Path(args.model) if args.model else tiny_model(work / "model")
    proc, url = start_server(model, work / "serve.log")
    rss: list[float] = []
    sampling = threading.Event()
    threading.Thread(target=rss_sampler, args=(proc.pid, sampling, rss), daemon=True).start()
    try:
        good_client(url, 5)  # warm-up: first requests size the KV cache
        base_rss = max(rss)
        alone = good_client(url, count)
        stop, statuses, covered, turns = threading.Event(), Counter(), threading.Event(), itertools.count()
        answered: set[int] = set()
        hostile = [threading.Thread(target=hostile_client, args=(url, stop, statuses, turns, answered, covered),
                                    daemon=True) for _ in range(args.hostile_threads)]
        for t in hostile:
            t.start()
        time.sleep(1.0)  # the hostile requests are in flight
        attacked = good_client(url, count, seconds, until=covered)
        stop.set()
        for t in hostile:
            t.join(60)
        in_flight_at_exit(url)
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        sampling.set()
    log = (work / "serve.log").read_text()
    figures = {"requests": len(attacked), "alone_p50_s": percentile(alone, 50), "alone_p99_s": percentile(alone, 99),
               "hostile_p50_s": percentile(attacked, 50), "hostile_p99_s": percentile(attacked, 99),
               "hostile_max_s": max(attacked), "rss_base_mb": base_rss, "rss_peak_mb": max(rss),
               "exit_code": code, "tracebacks": log.count("Traceback"), "statuses": dict(sorted(statuses.items()))}
    print(f"{'phase':<22}{'p50 s':>8}{'p99 s':>8}{'max s':>8}")
    print(f"{'alone':<22}{figures['alone_p50_s']:>8.3f}{figures['alone_p99_s']:>8.3f}{max(alone):>8.3f}")
    print(f"{'with hostile client':<22}{figures['hostile_p50_s']:>8.3f}{figures['hostile_p99_s']:>8.3f}"
          f"{figures['hostile_max_s']:>8.3f}")
    print(f"server RSS: {base_rss:.0f} MB after warm-up, {max(rss):.0f} MB at peak")
    print("hostile requests answered: " + ", ".join(f"{k}: {v}" for k, v in figures["statuses"].items()))
    print(f"SIGTERM: exit code {code}, {figures['tracebacks']} traceback(s) in the server's log")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    print(f"serve_hostile p99 with/without hostile client ratio "
          f"{figures['hostile_p99_s'] / figures['alone_p99_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
