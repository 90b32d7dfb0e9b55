"""miles_wire: the byte layouts, checksums and process groups both ends of a transport share."""
import subprocess
import sys
import threading
import time

import miles_wire as W
import pytest
import torch
from miles import MilesError


def test_buckets_respect_the_limit_and_keep_order():
    named = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([3, 4, 10, 1, 2])]
    got = [[n for n, _ in b] for b in W.buckets(named, 7)]
    assert got == [["t0", "t1"], ["t2"], ["t3", "t4"]]  # t2 alone exceeds the limit: its own bucket


def test_pack_and_views_round_trip_mixed_dtypes_bit_exactly():
    ts = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.tensor(2.5, dtype=torch.float16),
          torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.randn(4, 4).t()]  # last: non-contiguous
    offsets, total = W.layout([t.dtype for t in ts], [t.shape for t in ts])
    assert all(o % W.ALIGN == 0 for o in offsets) and total >= sum(W.nbytes(t) for t in ts)
    buf = torch.empty(total, dtype=torch.uint8)
    W.pack(ts, offsets, buf)
    back = W.views(buf, [W.dtype_name(t.dtype) for t in ts], [list(t.shape) for t in ts], offsets)
    for a, b in zip(ts, back):
        assert a.dtype == b.dtype and a.shape == b.shape and W.checksum(a) == W.checksum(b)
    assert back[0].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # views, no copy


def test_wire_plan_splits_on_pack_below():
    dtypes, shapes = ["float32", "bfloat16", "float32"], [[4], [1024], [256, 256]]
    plan = W.wire_plan(dtypes, shapes, pack_below=4096)
    assert plan.packed == [0, 1] and plan.direct == [2] and plan.packed_bytes == W.align(16) + 2048
    assert W.wire_plan(dtypes, shapes, 0).packed == []  # SGLang's one broadcast per tensor


def test_checksum_sees_one_flipped_bit_in_any_dtype():
    for t in (torch.randn(100), torch.randn(100).to(torch.bfloat16)):
        flipped = t.clone()
        flipped.view(torch.uint8)[17] ^= 1
        assert W.checksum(t) == W.checksum(t.clone()) != W.checksum(flipped)


def test_expect_same_names_the_first_difference_and_verify_checks_the_version():
    want = {"a": "1", "b": "2", "c": "3"}
    with pytest.raises(MilesError, match="engine tensor b has checksum x"):
        W.expect_same(want, {"a": "1", "b": "x", "c": "y"})
    with pytest.raises(MilesError, match="tensor c is missing"):
        W.expect_same(want, {"a": "1", "b": "2"})
    engine = type("E", (), {"weight_version": 4, "weight_checksums": lambda self, names: want,
                            "load_weights": lambda self, named, version: None})()  # an Engine (LoadsWeights)
    W.verify([engine], want, 4)
    with pytest.raises(MilesError, match="weight_version 4, expected 5"):
        W.verify([engine], want, 5)


def test_calls_fail_fast_and_return_results():
    assert W.parallel([lambda: 1, lambda: 2]) == [1, 2]
    calls = W.Calls([lambda: time.sleep(30), lambda: 1 / 0])
    t0 = time.perf_counter()
    with pytest.raises(ZeroDivisionError):
        calls.join()
    assert time.perf_counter() - t0 < 5  # did not wait for the slow call


def test_own_gloo_group_broadcasts_every_dtype_between_ranks():
    store = W.open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=30)
    got = {}

    def rank1():
        group = W.new_group(W.open_store("127.0.0.1", store.port, 2, is_master=False, timeout_s=30),
                            1, 2, "g", "gloo", 30)
        got["bf16"] = torch.empty(5, dtype=torch.bfloat16)
        W.broadcast(group, got["bf16"])

    peer = threading.Thread(target=rank1)
    peer.start()
    group = W.new_group(store, 0, 2, "g", "gloo", 30)
    sent = torch.randn(5).to(torch.bfloat16)
    W.broadcast(group, sent, check=lambda: None)
    peer.join(30)
    assert torch.equal(got["bf16"], sent)


def test_unknown_dtype_and_backend_are_clear_errors():
    with pytest.raises(MilesError, match="unknown dtype 'floaty'"):
        W.to_dtype("floaty")
    with pytest.raises(MilesError, match="unknown backend 'mpi'"):
        W.new_group(None, 0, 1, "g", "mpi", 1)


def test_importing_the_library_does_not_import_torch():
    code = ("import sys, miles_wire, miles_wire.testing; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_each_module_s_public_names_are_importable_from_the_package():
    import importlib

    for mod in ("dtypes", "bucketing", "packing", "calls", "verification", "groups", "disk"):
        m = importlib.import_module(f"miles_wire.{mod}")
        # its own functions and classes, and its constants (names imported into it are left out)
        own = [n for n, v in vars(m).items() if not n.startswith("_") and n != "TYPE_CHECKING"
               and getattr(v, "__module__", m.__name__) == m.__name__ and (callable(v) or n.isupper())]
        assert own, mod
        for name in own:
            assert getattr(W, name) is getattr(m, name), f"miles_wire.{name} (from {mod})"
            assert name in W.__all__, name
