"""The torch engine's receiving side of weight sync (SGLang's method names), in process."""
import threading
from multiprocessing import shared_memory

import pytest
import torch

from miles import MilesError
import miles_wire as W
from miles.testing import TinySpec, char_tokenizer
from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine


@pytest.fixture
def engine():
    return TorchEngine(TorchEngineConfig(), spec=TinySpec(seed=0), tokenizer=char_tokenizer())


def policy_weights(seed=1):
    return list(TinySpec(seed=seed).build_model(char_tokenizer()).state_dict().items())


def shm_bucket(named):
    """A bucket in a fresh shared memory segment and its ``miles-shm/1`` descriptor."""
    offsets, size = W.layout([t.dtype for _, t in named], [t.shape for _, t in named])
    shm = shared_memory.SharedMemory(create=True, size=size)
    buf = torch.frombuffer(shm.buf, dtype=torch.uint8)
    W.pack([t for _, t in named], offsets, buf)
    desc = {"format": W.SHM_FORMAT, "segment": shm.name, "size": size, "adopt": True,
            "tensors": [{"name": n, "dtype": W.dtype_name(t.dtype), "shape": list(t.shape), "offset": o}
                        for (n, t), o in zip(named, offsets)]}
    return shm, buf, desc


def test_adopted_parameters_view_the_segment_and_later_loads_never_write_into_it(engine, tmp_path):
    named = policy_weights()
    shm, buf, desc = shm_bucket(named)
    try:
        engine.update_weights_from_tensor([desc], weight_version=4)
        assert engine.weight_version == 4
        assert engine.weight_checksums([n for n, _ in named]) == {n: W.checksum(t) for n, t in named}
        weight = engine.model.model.layers[0].mlp.up_proj.weight
        entry = next(e for e in desc["tensors"] if e["name"] == "model.layers.0.mlp.up_proj.weight")
        buf[entry["offset"]:entry["offset"] + 4].view(torch.float32).fill_(7.0)
        assert weight.view(-1)[0].item() == 7.0  # a view of the shared segment: no engine-side copy
        original = dict(named)[entry["name"]].view(-1)[:1].view(torch.uint8)
        buf[entry["offset"]:entry["offset"] + 4].copy_(original)
        before = W.checksum(buf)
        from miles_plugin_disk.writer import write_version

        write_version(str(tmp_path), policy_weights(seed=2), 6, shard_mb=64, delta=False, keep=2)
        engine.update_weights_from_disk(str(tmp_path), 6)
        assert W.checksum(buf) == before  # the segment other engines may map is untouched
        buf[entry["offset"]:entry["offset"] + 4].view(torch.float32).fill_(9.0)
        assert weight.view(-1)[0].item() != 9.0  # the engine owns its memory again
        assert engine.weight_checksums() == {n: W.checksum(t) for n, t in policy_weights(seed=2)}
        assert engine.weight_version == 6
    finally:
        del buf
        shm.close()
        shm.unlink()


def test_bad_payloads_are_clear_errors(engine):
    with pytest.raises(MilesError, match="unknown tensor payload format 'pickle'"):
        engine.update_weights_from_tensor({"format": "pickle"})
    with pytest.raises(MilesError, match="invalid shared memory segment name"):
        engine.update_weights_from_tensor({"format": W.SHM_FORMAT, "segment": "../etc/passwd",
                                           "size": 4, "tensors": []})
    with pytest.raises(MilesError, match="no parameter or buffer named 'nope'"):
        engine.weight_checksums(["nope"])
    with pytest.raises(MilesError, match="no weights update group named 'g'"):
        engine.update_weights_from_distributed(["a"], ["float32"], [[1]], "g")


def test_distributed_receives_every_broadcast_before_reporting_a_bad_name(engine):
    named = policy_weights()
    bad = [("model.nope", torch.ones(3))] + named[:2]
    store = W.open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=30)
    joined = threading.Thread(target=engine.init_weights_update_group,
                              args=("127.0.0.1", store.port, 1, 2, "g", "gloo"))
    joined.start()
    group = W.new_group(store, 0, 2, "g", "gloo", 30)
    joined.join()

    def send(bucket, pack_below):
        dtypes = [W.dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        errors = []

        def receive():
            try:
                engine.update_weights_from_distributed([n for n, _ in bucket], dtypes, shapes, "g",
                                                       weight_version=2, pack_below=pack_below)
            except MilesError as e:
                errors.append(e)

        t = threading.Thread(target=receive)
        t.start()
        plan = W.wire_plan(dtypes, shapes, pack_below)
        if plan.packed:
            buf = torch.empty(plan.packed_bytes, dtype=torch.uint8)
            W.pack([bucket[i][1] for i in plan.packed], plan.offsets, buf)
            W.broadcast(group, buf)
        for i in plan.direct:
            W.broadcast(group, bucket[i][1])
        t.join(30)
        return errors

    for pack_below in (0, 1 << 30):
        errors = send(bad, pack_below)
        assert len(errors) == 1 and "'model.nope'" in str(errors[0])
    assert send(named, 1024) == []  # the group is still in step
    assert engine.weight_version == 2
    assert engine.weight_checksums() == {n: W.checksum(t) for n, t in named}
    engine.destroy_weights_update_group("g")
    with pytest.raises(MilesError, match="no weights update group"):
        engine.destroy_weights_update_group("g")
