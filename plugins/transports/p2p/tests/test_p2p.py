"""The ``p2p`` transport: the write plan, and real NIXL writes from this process into a real
``miles serve`` process (driven by the ``sglang`` engine plugin over HTTP), checked by checksum."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import miles_wire as W
import pytest
import torch
from miles import MilesError, SamplingParams, make_plugin_manager
from miles.testing import TinySpec, assert_lazy_registration, char_tokenizer
from miles_plugin_p2p.config import P2PSyncConfig
from miles_plugin_p2p.plan import cut, plan
from miles_plugin_p2p.transport import P2PTransport

ROOT = Path(__file__).resolve().parents[4]


def test_plan_round_robin_over_engine_ranks():
    # one trainer rank writes every bucket to every engine rank, bucket by bucket
    assert plan(2, 3) == [[(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]]
    # as many trainer ranks as engine ranks: each trainer rank feeds one engine rank
    assert plan(3, 2, 2) == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1), (2, 1)]]
    # fewer engine ranks: the buckets are split between trainer ranks
    assert plan(4, 1, 2) == [[(0, 0), (2, 0)], [(1, 0), (3, 0)]]
    # every (bucket, engine rank) write is made exactly once, the load balanced within one
    got = plan(5, 3, 4)
    writes = sorted(w for rank in got for w in rank)
    assert writes == [(b, e) for b in range(5) for e in range(3)]
    assert max(map(len, got)) - min(map(len, got)) <= 1
    assert plan(0, 2, 2) == [[], []] and plan(3, 0) == [[]]
    with pytest.raises(ValueError):
        plan(1, 1, 0)


def test_cut_buckets():
    assert cut([4, 4, 4, 4], 8) == [(0, 2), (2, 4)]
    assert cut([10, 1, 1], 8) == [(0, 1), (1, 3)]  # a large tensor forms a bucket of its own
    assert cut([1, 10, 1], 8) == [(0, 1), (1, 2), (2, 3)]
    assert cut([], 8) == []


def test_registration_is_lazy():
    assert_lazy_registration("miles_plugin_p2p", "transports", "p2p")


class InProcess:
    """An engine without a transfer endpoint (what an in-process engine is to this transport)."""

    weight_version = 0

    def load_weights(self, named, version):
        raise AssertionError("the p2p transport never hands tensors over by reference")


def test_engine_without_endpoint_is_refused_with_the_fix():
    with pytest.raises(MilesError, match="p2p_open.*transport.name=tensor"):
        P2PTransport(P2PSyncConfig()).sync(Policy(1), [InProcess()], 1)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """One ``miles serve`` process over an exported tiny model, and a ``sglang`` engine on it."""
    folder = tmp_path_factory.mktemp("export") / "model"
    tok = char_tokenizer()
    TinySpec(seed=0).build_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(folder), "--port", "0"],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    try:
        assert line and "listening on http://" in line[0], log.read_text()[-3000:]
        pm = make_plugin_manager()
        cfg = pm.registry("engines")["sglang"].config(urls=[line[0].strip().rsplit(" ", 1)[1]])
        engine = pm.create("engines", "sglang", cfg, spec=None, tokenizer=None, seed=0)
        yield engine
        engine.close()
    finally:
        proc.kill()
        proc.wait(30)


class Policy:
    def __init__(self, seed):
        self.model = TinySpec(seed=seed).build_model(char_tokenizer())

    def named_weights(self):
        return iter(self.model.state_dict().items())


def greedy(engine):
    out = engine.generate([[2, 5, 6, 7], [2, 9]], SamplingParams(max_new_tokens=6, temperature=0))
    return [c[0].token_ids for c in out]


def test_two_process_writes_are_bit_exact_and_versioned(client):
    policy = Policy(seed=2)
    transport = P2PTransport(P2PSyncConfig(verify=True, bucket_mb=1, workers=2))
    total = sum(W.nbytes(t) for _, t in policy.named_weights())
    for version in (1, 2):
        if version == 2:
            with torch.no_grad():
                policy.model.model.norm.weight.add_(0.5)
        m = transport.sync(policy, [client], version)  # verify=True: checksums compared inside
        assert client.weight_version == version
        assert m["weight_sync_bytes"] == total and "weight_sync_failed" not in m
        want = {n: W.checksum(t) for n, t in policy.named_weights()}
        assert client.weight_checksums(list(want)) == want
    layout = [{"name": n, "dtype": "float32", "shape": list(t.shape)} for n, t in policy.named_weights()]
    assert client.p2p_open(tensors=layout)[0]["direct"] == len(layout)  # into the parameters, no staging
    pm = make_plugin_manager()
    reference = pm.create("engines", "torch", pm.registry("engines")["torch"].config(),
                          spec=TinySpec(seed=0), tokenizer=char_tokenizer())
    reference.load_weights(list(policy.named_weights()), 0)
    assert greedy(client) == greedy(reference)  # the written weights are the ones generating
    transport.close()


class FreshCopies(Policy):
    """A trainer whose weights are new tensors at every sync (as a sharded trainer's gathers are)."""

    def named_weights(self):
        return ((n, t.clone()) for n, t in self.model.state_dict().items())


def test_weights_are_written_from_where_they_lie(client):
    """Contiguous CPU tensors in their own dtype go out without packing: no send buffer exists,
    the trainer's own parameters stay registered from the second sync on (same addresses twice),
    while tensors made afresh for one sync are released after it. Every sync is bit-exact."""
    policy, fresh = Policy(seed=9), FreshCopies(seed=10)
    transport = P2PTransport(P2PSyncConfig(verify=True, bucket_mb=1, workers=2))
    kept = []
    for version, source in enumerate([policy, policy, policy, fresh, fresh], start=21):
        transport.sync(source, [client], version)
        kept.append(transport._src is not None)
        assert client.weight_version == version
    assert transport._bufs == []  # nothing was packed
    assert kept == [False, True, True, False, False]
    transport.close()


def test_other_dtype_is_staged_and_converted_at_commit(client):
    policy = Policy(seed=3)
    transport = P2PTransport(P2PSyncConfig(dtype="bfloat16"))  # the engine holds float32
    transport.sync(policy, [client], 3)
    want = {n: W.checksum(t.to(torch.bfloat16).to(t.dtype)) for n, t in policy.named_weights()}
    assert client.weight_checksums(list(want)) == want
    assert client.weight_version == 3
    transport.close()


class Counting:
    """The client, counting the endpoint openings."""

    def __init__(self, inner):
        self.inner, self.opens = inner, 0

    def p2p_open(self, **kw):
        self.opens += 1
        return self.inner.p2p_open(**kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_endpoints_are_reused_until_parameters_move(client, tmp_path):
    policy, counted = Policy(seed=7), Counting(client)
    p2p = P2PTransport(P2PSyncConfig(verify=True))
    for version in (11, 12):
        p2p.sync(policy, [counted], version)
    assert counted.opens == 1  # the second sync wrote into the endpoints of the first
    # a broadcast re-points the server's parameters into its packed receive buffers
    pm = make_plugin_manager()
    broadcast = pm.create("transports", "broadcast", pm.registry("transports")["broadcast"].config(verify=True),
                          out_dir=str(tmp_path))
    broadcast.sync(Policy(seed=8), [client], 13)
    broadcast.close()
    with torch.no_grad():
        policy.model.model.norm.weight.add_(1.0)
    m = p2p.sync(policy, [counted], 14)  # the commit finds them moved: opened afresh, written, verified
    assert counted.opens == 2 and client.weight_version == 14 and "weight_sync_failed" not in m
    p2p.close()


class WrongSizes:
    """The client, but its endpoint announces a wrong size for one tensor of the second bucket."""

    def __init__(self, inner):
        self.inner = inner

    def p2p_open(self, **kw):
        infos = self.inner.p2p_open(**kw)
        for info in infos:
            info["targets"][-1][1] += 4
        return infos

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_write_error_names_the_engine_and_the_bucket(client):
    policy = Policy(seed=4)
    transport = P2PTransport(P2PSyncConfig(bucket_mb=1))
    with pytest.raises(MilesError, match=r"bucket \d+ \(.*\) to engine http://127.0.0.1:\d+.*expects"):
        transport.sync(policy, [WrongSizes(client)], 4)
    assert client.weight_version != 4  # not committed
    transport.close()


def _serve(folder, log, port=0, *settings):
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(folder), "--port", str(port),
                             *settings],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=open(log, "a"), text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    assert line and "listening on http://" in line[0], log.read_text()[-3000:]
    return proc, line[0].strip().rsplit(" ", 1)[1]


class DiesAfterOpen:
    """The client, but its server is killed right after it published its endpoint."""

    def __init__(self, inner, proc):
        self.inner, self.proc = inner, proc

    def p2p_open(self, **kw):
        infos = self.inner.p2p_open(**kw)
        self.proc.kill()
        self.proc.wait(30)
        return infos

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.slow  # two server starts
def test_engine_dead_mid_transfer_misses_the_version_and_is_resynced_when_back(tmp_path):
    folder, log = tmp_path / "model", tmp_path / "serve.log"
    tok = char_tokenizer()
    TinySpec(seed=0).build_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    proc, url = _serve(folder, log)
    procs = [proc]
    pm = make_plugin_manager()
    client = pm.create("engines", "sglang", pm.registry("engines")["sglang"].config(
        urls=[url], restart_wait_s=60), spec=None, tokenizer=None, seed=0)
    try:
        policy = Policy(seed=5)
        transport = P2PTransport(P2PSyncConfig(verify=True, timeout_s=20))
        m = transport.sync(policy, [DiesAfterOpen(client, proc)], 1)
        assert m["weight_sync_failed"] == 1.0  # not an error: the run goes on without that server
        assert client.servers_down() == [url]
        procs.append(_serve(folder, log, int(url.rsplit(":", 1)[1]))[0])  # back, on its boot weights
        m = transport.sync(policy, [client], 2)  # a new agent there: re-opened, written, verified
        assert "weight_sync_failed" not in m and client.weight_version == 2
        want = {n: W.checksum(t) for n, t in policy.named_weights()}
        assert client.weight_checksums(list(want)) == want
    finally:
        client.close()
        for p in procs:
            p.kill()
            p.wait(30)


@pytest.mark.gpu
def test_gpu_engine_registers_its_gpu_memory(tmp_path):
    """A `miles serve` engine on a GPU: destinations are its GPU parameters (VRAM), written from
    the trainer's host send buffers; a trainer on the GPU too."""
    folder, log = tmp_path / "model", tmp_path / "serve.log"
    tok = char_tokenizer()
    TinySpec(seed=0).build_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    proc, url = _serve(folder, log, 0, "device=cuda")
    pm = make_plugin_manager()
    client = pm.create("engines", "sglang", pm.registry("engines")["sglang"].config(urls=[url]),
                       spec=None, tokenizer=None, seed=0)
    try:
        policy = Policy(seed=6)
        policy.model.cuda()
        transport = P2PTransport(P2PSyncConfig(verify=True, bucket_mb=0.02))
        for version in (1, 2):
            transport.sync(policy, [client], version)
            assert client.weight_version == version
        layout = [{"name": n, "dtype": "float32", "shape": list(t.shape)} for n, t in policy.named_weights()]
        info = client.p2p_open(tensors=layout)[0]
        assert info["mem_type"] == "VRAM" and info["direct"] == len(layout)
    finally:
        client.close()
        proc.kill()
        proc.wait(30)
