"""Every transport through a real ``miles serve`` process driven by the ``sglang`` engine plugin
(HTTP, SGLang's weight endpoints): bit-exact checksums, versions, and the generations of an
in-process engine holding the same weights."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from miles import MilesError, SamplingParams, make_plugin_manager
import miles_wire as W
from miles.testing import TinySpec, char_tokenizer

ROOT = Path(__file__).resolve().parents[1]


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


def reference_greedy(policy):
    pm = make_plugin_manager()
    engine = pm.create("engines", "torch", pm.registry("engines")["torch"].config(),
                       spec=TinySpec(seed=0), tokenizer=char_tokenizer())
    engine.load_weights(list(policy.named_weights()), 0)
    return greedy(engine)


@pytest.mark.parametrize("name", ["tensor", "broadcast", "disk"])
def test_transport_through_miles_serve(client, name, tmp_path):
    pm = make_plugin_manager()
    settings = {"verify": True, **({"dir": str(tmp_path / "w")} if name == "disk" else {})}
    transport = pm.create("transports", name, pm.registry("transports")[name].config(**settings),
                          out_dir=str(tmp_path))
    policy = Policy(seed={"tensor": 1, "broadcast": 2, "disk": 3}[name])
    for version in (1, 2):
        if version == 2:
            with torch.no_grad():
                policy.model.model.norm.weight.add_(0.5)
        transport.sync(policy, [client], version)
        assert client.weight_version == version
        want = {n: W.checksum(t) for n, t in policy.named_weights()}
        assert client.weight_checksums(list(want)) == want
    assert greedy(client) == reference_greedy(policy)
    if hasattr(transport, "close"):
        transport.close()


def test_a_server_error_reaches_the_trainer(client):
    pm = make_plugin_manager()
    transport = pm.create("transports", "tensor", pm.registry("transports")["tensor"].config())
    wrong = type("T", (), {"named_weights": lambda self: iter([("model.nope", torch.ones(2))])})()
    with pytest.raises(MilesError, match="model.nope"):
        transport.sync(wrong, [client], 9)
    transport.close()
