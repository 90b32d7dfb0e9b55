import time

import pytest
import torch

from miles import MilesError, SamplingParams
import miles_wire as W
from miles.testing import TinySpec, assert_lazy_registration, char_tokenizer
from miles_wire.testing import EngineProcess
from miles_plugin_broadcast.config import BroadcastSyncConfig
from miles_plugin_broadcast.transport import BroadcastTransport


@pytest.fixture(scope="module")
def engine_process():
    engine = EngineProcess(spec=TinySpec(hidden=64, seed=0))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference():
    """An in-process torch engine: the same weights loaded by reference must generate the same."""
    return make_engine()


class Policy:
    """A trainer double over a tiny Qwen2 (tied embeddings); ``step()`` changes every weight."""

    def __init__(self, seed=1):
        self.model = TinySpec(hidden=64, seed=seed).build_model(char_tokenizer())

    def named_weights(self):
        return iter(self.model.state_dict().items())

    def step(self):
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(1.01).add_(0.001)


def greedy(engine):
    out = engine.generate([[2, 5, 6, 7], [2, 9]], SamplingParams(max_new_tokens=6, temperature=0))
    return [c[0].token_ids for c in out]


# pack_mb: the default (everything of this tiny model packed), a mix of packed and direct
# tensors (1 KiB), and SGLang's one broadcast per tensor (0)
@pytest.mark.parametrize("pack_mb", [None, 1 / 1024, 0])
def test_engine_process_gets_every_version_bit_exactly(engine_process, reference, pack_mb):
    policy = Policy()
    transport = BroadcastTransport(BroadcastSyncConfig(verify=True, pack_mb=pack_mb, timeout_s=60))
    for version in (1, 2):
        m = transport.sync(policy, [engine_process], version)
        assert engine_process.weight_version == version
        assert m["weight_sync_bytes"] == sum(W.nbytes(t) for _, t in policy.named_weights())
        assert (m["weight_sync_connect_seconds"] > 0) == (version == 1)  # one group, reused
        want = {n: W.checksum(t) for n, t in policy.named_weights()}
        assert engine_process.weight_checksums(list(want)) == want
        reference.load_weights(list(policy.named_weights()), 0)
        assert greedy(engine_process) == greedy(reference)
        policy.step()
    transport.close()


def make_engine(**settings):
    from miles import make_plugin_manager

    pm = make_plugin_manager()
    cfg = pm.registry("engines")["torch"].config(**settings)
    return pm.create("engines", "torch", cfg, spec=TinySpec(hidden=64, seed=0), tokenizer=char_tokenizer())


def test_packed_buckets_are_received_straight_into_the_parameters():
    """From the first sync on, an engine's parameters live in their bucket's receive buffer:
    later versions land in them with no copy. Tied names share a Parameter, so theirs is copied."""
    policy, engine, ref = Policy(), make_engine(), make_engine()
    transport = BroadcastTransport(BroadcastSyncConfig(verify=True, timeout_s=60))
    def homed():
        return {n: p.data_ptr() for n, p in engine.model.named_parameters() if "embed" not in n}

    before = homed()
    for version in (1, 2, 3):
        transport.sync(policy, [engine], version)
        if version == 1:
            after = homed()
            assert all(after[n] != before[n] for n in after)  # moved into their home
            (buf,) = engine._ws.homes.values()
            assert all(0 <= p - buf.data_ptr() < buf.numel() for p in after.values())
        assert homed() == after  # and stay there: later versions arrive in place
        assert engine.weight_version == version  # verify=True checked every tensor's bytes
        ref.load_weights(list(policy.named_weights()), version)
        assert greedy(engine) == greedy(ref)
        policy.step()
    transport.close()


def test_weights_travel_as_sync_dtype():
    policy, engine = Policy(), make_engine(dtype="bfloat16")
    transport = BroadcastTransport(BroadcastSyncConfig(verify=True, dtype="bfloat16", timeout_s=60))
    m = transport.sync(policy, [engine], 1)
    assert m["weight_sync_bytes"] == sum(W.nbytes(t) for _, t in policy.named_weights()) / 2
    want = {n: W.checksum(t.to(torch.bfloat16)) for n, t in policy.named_weights()}
    assert engine.weight_checksums(list(want)) == want
    transport.close()


def test_verify_names_the_tensor_an_engine_process_got_wrong(engine_process):
    transport = BroadcastTransport(BroadcastSyncConfig(verify=True, timeout_s=60))
    engine_process.corrupt_after_updates("model.layers.0.mlp.down_proj.weight")
    try:
        with pytest.raises(MilesError, match=r"engine tensor model\.layers\.0\.mlp\.down_proj\.weight"):
            transport.sync(Policy(), [engine_process], version=5)
    finally:
        engine_process.corrupt_after_updates(None)
        transport.close()


class InProcess:
    """An engine of ``ranks`` servers (a ``ServerGroup``) joining from threads of this process; it
    records its calls and refuses every bucket."""

    remote = True
    restarts = 0

    def __init__(self, ranks=1):
        self.num_weight_ranks = ranks
        self.calls, self.groups = [], []

    def servers_down(self):
        return []

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name, backend):
        self.calls.append(("init", rank_offset, world_size, backend))

        def join(rank):
            store = W.open_store(master_address, master_port, world_size, is_master=False, timeout_s=30)
            self.groups.append(W.new_group(store, rank, world_size, group_name, backend, 30))

        W.parallel([lambda r=rank_offset + i: join(r) for i in range(self.num_weight_ranks)])

    def update_weights_from_distributed(self, **kw):
        raise RuntimeError("engine refused the bucket")

    def destroy_weights_update_group(self, group_name):
        self.calls.append(("destroy", group_name))
        for group in self.groups:  # as an engine server does: its side of the group goes away
            group.shutdown()
        self.groups = []


def test_engines_of_several_servers_take_consecutive_ranks():
    a, b = InProcess(ranks=2), InProcess(ranks=1)
    transport = BroadcastTransport(BroadcastSyncConfig(timeout_s=30))
    transport._connect([a, b], torch.zeros(1))
    assert a.calls == [("init", 1, 4, "gloo")] and b.calls == [("init", 3, 4, "gloo")]
    transport.close()
    assert a.calls[-1][0] == "destroy" == b.calls[-1][0]


def test_an_engine_that_fails_its_call_fails_the_sync_at_once():
    class Big:
        def named_weights(self):
            yield "w", torch.zeros(64 << 20, dtype=torch.uint8)  # more than a socket buffer holds

    transport = BroadcastTransport(BroadcastSyncConfig(timeout_s=120))
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="engine refused the bucket"):
        transport.sync(Big(), [InProcess()], version=1)
    assert time.perf_counter() - t0 < 30  # not the 120 s timeout
    t0 = time.perf_counter()
    transport.close()  # the engine leaves the group, so the bucket it refused is not waited for
    assert time.perf_counter() - t0 < 30


def test_only_trainer_rank_0_sends():
    class Rank1(Policy):
        rank, world_size = 1, 2

        def named_weights(self):
            self.iterated = True
            return super().named_weights()

    trainer = Rank1()
    m = BroadcastTransport(BroadcastSyncConfig()).sync(trainer, [InProcess()], 1)
    assert trainer.iterated and m["weight_sync_bytes"] == 0


def test_registration_is_lazy_and_config_is_checked():
    assert_lazy_registration("miles_plugin_broadcast", "transports", "broadcast")
    with pytest.raises(ValueError):
        BroadcastSyncConfig(backend="mpi")
    with pytest.raises(ValueError):
        BroadcastSyncConfig(bucket_gb=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL needs one GPU per rank: run on a machine with 2 GPUs")
def test_nccl_broadcast_between_two_gpus():
    policy = Policy()
    policy.model.to("cuda:0")
    engine = EngineProcess(settings={"device": "cuda:1"}, spec=TinySpec(hidden=64, seed=0))
    try:
        for pack_mb in (None, 0):
            transport = BroadcastTransport(BroadcastSyncConfig(verify=True, pack_mb=pack_mb, timeout_s=120))
            transport.sync(policy, [engine], 1)
            assert transport._backend == "nccl" and engine.weight_version == 1
            want = {n: W.checksum(t) for n, t in policy.named_weights()}
            assert engine.weight_checksums(list(want)) == want
            transport.close()
            policy.step()
    finally:
        engine.close()


def test_cached_receive_views_follow_parameters_moved_by_another_transport(engine_process):
    """The engine keeps each bucket's receive views between syncs; once shared-memory adoption
    has moved its parameters elsewhere, the next broadcast must still land every byte."""
    from miles_plugin_tensor.config import TensorSyncConfig
    from miles_plugin_tensor.transport import TensorTransport

    policy = Policy(seed=3)
    broadcast = BroadcastTransport(BroadcastSyncConfig(verify=True, timeout_s=60))
    tensor = TensorTransport(TensorSyncConfig(verify=True))
    try:
        for version, transport in enumerate([broadcast, broadcast, tensor, broadcast, broadcast], 10):
            policy.step()
            transport.sync(policy, [engine_process], version)  # verify=true checks every tensor
            assert engine_process.weight_version == version
    finally:
        broadcast.close()
        tensor.close()


class Counting:
    """The caller's view of a real engine, counting its update calls (the unit here is the
    transport: how often it talks to the engine)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def update_weights_from_distributed(self, **kw):
        self.calls.append(kw.get("buckets"))
        return self.engine.update_weights_from_distributed(**kw)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_later_syncs_are_announced_in_one_call_and_arrive_bit_exactly():
    """~5 MiB in 1 MiB buckets: the first sync announces each bucket; later ones (same buckets)
    are announced once, the broadcasts queued back to back through two send buffers."""
    spec = dict(hidden=256, layers=3, heads=4, kv_heads=2, seed=0)
    engine = EngineProcess(spec=TinySpec(**spec))
    try:
        assert engine.accepts_buckets is True
        policy = Policy()
        policy.model = TinySpec(**{**spec, "seed": 1}).build_model(char_tokenizer())
        counting = Counting(engine)
        transport = BroadcastTransport(BroadcastSyncConfig(bucket_mb=1, pack_mb=1 / 64, timeout_s=60))
        for version in (1, 2, 3):
            counting.calls.clear()
            transport.sync(policy, [counting], version)
            want = {n: W.checksum(t) for n, t in policy.named_weights()}
            assert engine.weight_checksums(list(want)) == want
            assert engine.weight_version == version
            if version == 1:
                assert len(counting.calls) > 2 and set(counting.calls) == {None}
            else:
                (counts,) = counting.calls
                assert len(counts) > 2 and sum(counts) == len(want)
            policy.step()
        transport.close()
    finally:
        engine.close()
