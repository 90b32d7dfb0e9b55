import os
import shutil

import pytest
import torch

from miles import MilesError
from miles_plugin_disk import layout, writer
from miles_plugin_disk.config import DiskSyncConfig
from miles_plugin_disk.reader import load_version, read_manifest
from miles_plugin_disk.transport import DiskTransport
from miles.testing import assert_lazy_registration


class Holder:
    """A test double standing in for both sides: a module whose weights are read or loaded."""

    def __init__(self, seed, *sizes, bf16_last=False):
        torch.manual_seed(seed)
        sizes = sizes or (4, 8, 2)
        self.m = torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])))
        if bf16_last:
            self.m[-1].to(torch.bfloat16)
        self.weight_version = 0
        self.received = {}

    def named_weights(self):
        return iter(self.m.state_dict().items())

    def load_weights(self, named, version):
        self.received = dict(named)  # kept as handed over, to check dtypes survived the trip
        self.m.load_state_dict(self.received)
        self.weight_version = version


def assert_same(trainer, engine):
    want = dict(trainer.named_weights())
    assert want.keys() == engine.received.keys()
    for name, t in want.items():
        got = engine.received[name]
        assert got.dtype == t.dtype and torch.equal(got, t), name


def transport(tmp_path, **kw):
    return DiskTransport(DiskSyncConfig(dir=str(tmp_path / "w"), **kw))


def folders(t):
    return {n for n in os.listdir(t.dir) if n != layout.LATEST}


def test_bit_exact_float32_and_bfloat16_with_version_and_metrics(tmp_path):
    trainer, engine = Holder(0, bf16_last=True), Holder(1, bf16_last=True)
    assert {t.dtype for _, t in trainer.named_weights()} == {torch.float32, torch.bfloat16}
    m = transport(tmp_path, verify=True).sync(trainer, [engine], version=7)
    assert_same(trainer, engine)
    assert engine.weight_version == 7
    total = sum(t.numel() * t.element_size() for _, t in trainer.named_weights())
    assert m["weight_sync_bytes"] == total and m["weight_sync_tensors_written"] == 4
    assert m["weight_sync_delta_fraction"] == 1.0 and m["weight_sync_seconds"] >= 0
    assert read_manifest(tmp_path / "w")["version"] == 7
    assert read_manifest(tmp_path / "w", 7)["tensors"]["1.weight"]["dtype"] == "bfloat16"


def test_shards_split_at_shard_mb(tmp_path):
    trainer, engine = Holder(0, 600, 512, 300), Holder(1, 600, 512, 300)  # 1.2 MiB + 0.6 MiB weights
    t = transport(tmp_path, shard_mb=1)
    t.sync(trainer, [engine], version=1)
    assert_same(trainer, engine)
    per_shard = {}
    for e in read_manifest(t.dir)["tensors"].values():
        per_shard.setdefault(e["file"], []).append(e["nbytes"])
    assert len(per_shard) == 2 and len(os.listdir(os.path.join(t.dir, "v00000001"))) == 3
    # a tensor above the limit gets a shard of its own; the rest pack up to the limit
    assert all(len(sizes) == 1 or sum(sizes) <= 1 << 20 for sizes in per_shard.values())


def test_delta_writes_changed_tensors_only_and_prunes_unreferenced(tmp_path):
    trainer, engine = Holder(0), Holder(1)
    t = transport(tmp_path, delta=True, keep=2)
    changes = {2: "0.weight", 3: "0.bias", 4: "0.weight", 5: None}
    m = t.sync(trainer, [engine], version=1)
    assert m["weight_sync_tensors_written"] == 4
    for version, name in changes.items():
        if name:
            with torch.no_grad():
                trainer.m.state_dict()[name].add_(1.0)
        m = t.sync(trainer, [engine], version)
        assert_same(trainer, engine)
        assert m["weight_sync_tensors_written"] == (1 if name else 0)
        nbytes = trainer.m.state_dict()[name].numel() * 4 if name else 0
        assert m["weight_sync_bytes"] == nbytes and m["weight_sync_delta_fraction"] < 1
    files = {n: e["file"].split("/")[0] for n, e in read_manifest(t.dir)["tensors"].items()}
    assert files == {"0.weight": "v00000004", "0.bias": "v00000003",
                     "1.weight": "v00000001", "1.bias": "v00000001"}
    # the two newest, plus every folder the newest manifest still reads from; v2 is gone
    assert folders(t) == {"v00000005", "v00000004", "v00000003", "v00000001"}
    fresh = Holder(2)
    fresh.load_weights(load_version(t.dir, verify=True), 5)
    assert_same(trainer, fresh)


def test_crash_mid_write_keeps_previous_version(tmp_path, monkeypatch):
    trainer, engine = Holder(0, 600, 512, 300), Holder(1, 600, 512, 300)
    t = transport(tmp_path, shard_mb=1, verify=True)
    t.sync(trainer, [engine], version=1)
    before = {n: v.clone() for n, v in trainer.named_weights()}
    with torch.no_grad():
        for p in trainer.m.parameters():
            p.add_(1.0)
    real, calls = writer.save_file, []

    def dies_on_second_shard(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        real(*a, **kw)

    monkeypatch.setattr(writer, "save_file", dies_on_second_shard)
    with pytest.raises(RuntimeError, match="disk full"):
        t.sync(trainer, [engine], version=2)
    assert layout.latest(t.dir) == "v00000001" and folders(t) == {"v00000001"}
    loaded = dict(load_version(t.dir, verify=True))
    assert all(torch.equal(loaded[n], v) for n, v in before.items())
    monkeypatch.setattr(writer, "save_file", real)
    os.makedirs(os.path.join(t.dir, "v00000009.tmp"))  # what a killed writer leaves behind
    t.sync(trainer, [engine], version=2)
    assert_same(trainer, engine)
    assert layout.latest(t.dir) == "v00000002" and folders(t) == {"v00000001", "v00000002"}


def test_plain_sync_skips_checksums_but_still_stores_tied_tensors_once(tmp_path):
    trainer = Holder(0)
    named = list(trainer.named_weights()) + [("tied.weight", trainer.m[0].weight.data)]
    plain = type("T", (), {"named_weights": lambda self: iter(named)})()
    t = transport(tmp_path)
    reader = type("E", (), {"weight_version": 0, "load_weights": lambda self, named, v: dict(named)})()
    m = t.sync(plain, [reader], version=1)
    entries = read_manifest(t.dir)["tensors"]
    assert not any("blake2b" in e for e in entries.values())
    assert entries["tied.weight"]["key"] == entries["0.weight"]["key"] and m["weight_sync_tensors_written"] == 4
    with pytest.raises(MilesError, match="without a checksum"):
        list(load_version(t.dir, verify=True))


def test_verify_names_the_tensor_of_a_corrupted_shard(tmp_path):
    trainer = Holder(0, 600, 512, 300)
    t = transport(tmp_path, shard_mb=1, verify=True)
    t.sync(trainer, [Holder(1, 600, 512, 300)], version=1)
    path = os.path.join(t.dir, read_manifest(t.dir)["tensors"]["0.weight"]["file"])
    with open(path, "r+b") as f:  # the shard holds only 0.weight, so its last byte is that tensor's
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(MilesError, match=r"tensor 0\.weight .*checksum"):
        list(load_version(t.dir, verify=True))
    assert len(list(load_version(t.dir))) == 4  # without verify the flip goes unnoticed


def test_resyncing_an_existing_version_never_touches_the_committed_folder(tmp_path):
    trainer, engine = Holder(0), Holder(1)
    t = transport(tmp_path)
    t.sync(trainer, [engine], version=1)
    t.sync(trainer, [engine], version=2)
    with torch.no_grad():
        trainer.m[0].weight.mul_(2)
    t.sync(trainer, [engine], version=1)  # a run resumed from the version-1 checkpoint
    assert layout.latest(t.dir) == "v00000001.r1" and folders(t) == {"v00000001.r1"}
    assert_same(trainer, engine)
    assert engine.weight_version == 1
    with pytest.raises(MilesError, match="version 2"):
        read_manifest(t.dir, 2)


def test_real_torch_engine_with_tied_embeddings(tmp_path):
    from miles.testing import TinySpec, char_tokenizer
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    tok = char_tokenizer()
    policy = TinySpec(seed=1).build_model(tok)
    trainer = type("T", (), {"named_weights": lambda self: iter(policy.state_dict().items())})()
    engine = TorchEngine(TorchEngineConfig(), spec=TinySpec(seed=0), tokenizer=tok)
    m = transport(tmp_path, verify=True).sync(trainer, [engine], version=3)
    assert engine.weight_version == 3
    have = engine.model.state_dict()
    for name, want in policy.state_dict().items():
        assert torch.equal(have[name], want), name
    entries = read_manifest(tmp_path / "w")["tensors"]
    # tied lm_head/embeddings (and the all-ones norms) hold the same bytes, so they are stored once
    assert entries["lm_head.weight"]["key"] == entries["model.embed_tokens.weight"]["key"]
    assert m["weight_sync_tensors_written"] == len({e["key"] for e in entries.values()}) < len(entries)


def test_registration_is_lazy_and_out_dir_sets_the_default_dir(tmp_path):
    assert_lazy_registration("miles_plugin_disk", "transports", "disk")
    from miles_plugin_disk import _make

    assert _make(DiskSyncConfig(), out_dir=str(tmp_path)).dir == str(tmp_path / "weights")
    default = _make(DiskSyncConfig()).dir
    assert os.path.basename(default) == "weights" and os.path.isdir(default)
    shutil.rmtree(os.path.dirname(default))
    with pytest.raises(ValueError):
        DiskSyncConfig(shard_gb=1)


# -- an engine in another process: update_weights_from_disk ---------------------------------------
from miles import SamplingParams  # noqa: E402
import miles_wire as W  # noqa: E402
from miles.testing import TinySpec  # noqa: E402
from miles_wire.testing import EngineProcess  # noqa: E402


@pytest.fixture(scope="module")
def engine_process():
    engine = EngineProcess(spec=TinySpec(seed=0))
    yield engine
    engine.close()


def greedy(engine):
    out = engine.generate([[2, 5, 6, 7], [2, 9]], SamplingParams(max_new_tokens=6, temperature=0))
    return [c[0].token_ids for c in out]


@pytest.mark.parametrize("delta", [False, True])
def test_engine_process_loads_every_version_bit_exactly(tmp_path, engine_process, delta):
    from miles.testing import char_tokenizer
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    policy = TinySpec(seed=1).build_model(char_tokenizer())
    trainer = type("T", (), {"named_weights": lambda self: iter(policy.state_dict().items())})()
    reference = TorchEngine(TorchEngineConfig(), spec=TinySpec(seed=0), tokenizer=char_tokenizer())
    t = transport(tmp_path, verify=True, delta=delta)
    for version in (1, 2):
        m = t.sync(trainer, [engine_process], version)
        assert engine_process.weight_version == version and m["weight_sync_load_seconds"] > 0
        want = {n: W.checksum(x) for n, x in policy.state_dict().items()}
        assert engine_process.weight_checksums(list(want)) == want
        reference.load_weights(list(trainer.named_weights()), version)
        assert greedy(engine_process) == greedy(reference)
        with torch.no_grad():
            policy.model.layers[0].mlp.up_proj.weight.add_(0.01)  # delta: only this one is rewritten
    if delta:  # version 2 rewrote the one tensor that changed; the engine read the rest from v1
        assert m["weight_sync_tensors_written"] == 1


def test_verify_names_the_tensor_an_engine_process_got_wrong(tmp_path, engine_process):
    from miles.testing import char_tokenizer

    policy = TinySpec(seed=1).build_model(char_tokenizer())
    trainer = type("T", (), {"named_weights": lambda self: iter(policy.state_dict().items())})()
    engine_process.corrupt_after_updates("model.norm.weight")
    try:
        with pytest.raises(MilesError, match=r"engine tensor model\.norm\.weight"):
            transport(tmp_path, verify=True).sync(trainer, [engine_process], version=3)
    finally:
        engine_process.corrupt_after_updates(None)
