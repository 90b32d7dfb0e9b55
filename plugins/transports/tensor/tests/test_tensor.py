import pytest
import torch

from miles import MilesError
import miles_wire as W
from miles_plugin_tensor.transport import TensorSyncConfig, TensorTransport


class Holder:
    """A test double standing in for both sides: a module whose weights are read or loaded."""

    def __init__(self, seed):
        torch.manual_seed(seed)
        self.m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        self.weight_version = 0

    def named_weights(self):
        return iter(self.m.state_dict().items())

    def load_weights(self, named, version):
        self.m.load_state_dict(dict(named))
        self.weight_version = version


def test_sync_copies_bit_exactly_and_reports_bytes_and_version():
    trainer, engine = Holder(0), Holder(1)
    m = TensorTransport(TensorSyncConfig(verify=True)).sync(trainer, [engine], version=7)
    for (n, a), (_, b) in zip(trainer.named_weights(), engine.named_weights()):
        assert torch.equal(a, b), n
    assert engine.weight_version == 7
    assert m["weight_sync_bytes"] == sum(t.numel() * 4 for t in trainer.m.state_dict().values())
    assert m["weight_sync_seconds"] >= 0


def test_verify_fails_loudly_on_a_mismatch():
    class Lossy(Holder):
        def load_weights(self, named, version):
            super().load_weights([(n, t + 1e-3) for n, t in named], version)

    with pytest.raises(MilesError, match="verification failed"):
        TensorTransport(TensorSyncConfig(verify=True)).sync(Holder(0), [Lossy(1)], version=1)


def test_registration_is_lazy():
    from miles.testing import assert_lazy_registration

    assert_lazy_registration("miles_plugin_tensor", "transports", "tensor")


# -- an engine in another process: shared memory hand-off -----------------------------------------
from miles import SamplingParams  # noqa: E402
from miles.testing import TinySpec, char_tokenizer  # noqa: E402
from miles_wire.testing import EngineProcess  # noqa: E402


@pytest.fixture(scope="module")
def engine_process():
    engine = EngineProcess(spec=TinySpec(seed=0))
    yield engine
    engine.close()


class Policy:
    """A trainer double over a tiny Qwen2 (tied embeddings); ``step()`` changes every weight."""

    def __init__(self, seed=1):
        self.model = TinySpec(seed=seed).build_model(char_tokenizer())

    def named_weights(self):
        return iter(self.model.state_dict().items())

    def step(self):
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(1.01).add_(0.001)


def greedy(engine, prompts=((2, 5, 6, 7), (2, 9))):
    return [c[0].token_ids for c in engine.generate([list(p) for p in prompts],
                                                    SamplingParams(max_new_tokens=6, temperature=0))]


@pytest.fixture(scope="module")
def reference():
    """An in-process torch engine: the same weights loaded by reference must generate the same."""
    from miles import make_plugin_manager

    pm = make_plugin_manager()
    cfg = pm.registry("engines")["torch"].config()
    return pm.create("engines", "torch", cfg, spec=TinySpec(seed=0), tokenizer=char_tokenizer())


def expected_greedy(reference, policy):
    reference.load_weights(list(policy.named_weights()), 0)
    return greedy(reference)


def segments(transport):
    import os

    pool = transport._pool
    return sorted(n for n in os.listdir("/dev/shm") if pool and n.startswith(pool.prefix))


@pytest.mark.parametrize("adopt", [True, False])
def test_engine_process_gets_every_version_bit_exactly(engine_process, reference, adopt):
    policy = Policy()
    transport = TensorTransport(TensorSyncConfig(verify=True, adopt=adopt, bucket_mb=1))
    for version in (1, 2, 3):  # with adopt, versions alternate between two segment sets
        m = transport.sync(policy, [engine_process], version)
        assert engine_process.weight_version == version
        assert m["weight_sync_bytes"] == sum(W.nbytes(t) for _, t in policy.named_weights())
        want = {n: W.checksum(t) for n, t in policy.named_weights()}
        assert engine_process.weight_checksums(list(want)) == want
        assert greedy(engine_process) == expected_greedy(reference, policy)
        policy.step()
    assert len(segments(transport)) == (2 if adopt else 1)
    transport.close()
    assert segments(transport) == []  # unlinked


def test_verify_names_the_tensor_an_engine_process_got_wrong(engine_process):
    engine_process.corrupt_after_updates("model.layers.1.self_attn.o_proj.weight")
    try:
        with pytest.raises(MilesError, match=r"engine tensor model\.layers\.1\.self_attn\.o_proj\.weight"):
            TensorTransport(TensorSyncConfig(verify=True)).sync(Policy(), [engine_process], version=9)
    finally:
        engine_process.corrupt_after_updates(None)


def test_only_trainer_rank_0_sends():
    class Rank1(Policy):
        rank, world_size = 1, 2

        def named_weights(self):
            self.iterated = True
            return super().named_weights()

    class NoCalls:
        remote = True

        def __getattr__(self, name):
            raise AssertionError(f"rank 1 called engine.{name}")

    trainer = Rank1()
    m = TensorTransport(TensorSyncConfig(verify=True)).sync(trainer, [NoCalls()], version=1)
    assert trainer.iterated and m["weight_sync_bytes"] == 0


@pytest.mark.gpu
def test_cuda_ipc_into_an_engine_process_on_the_gpu():
    """Trainer weights on the GPU reach an engine process on the same GPU through CUDA IPC."""
    policy = Policy()
    policy.model.cuda()
    engine = EngineProcess(settings={"device": "cuda"}, spec=TinySpec(seed=0))
    try:
        transport = TensorTransport(TensorSyncConfig(verify=True))
        for version in (1, 2):
            transport.sync(policy, [engine], version)
            assert engine.weight_version == version
            want = {n: W.checksum(t) for n, t in policy.named_weights()}
            assert engine.weight_checksums(list(want)) == want
            policy.step()
        assert transport._pool is None  # no shared memory involved
    finally:
        engine.close()


def test_a_segment_too_big_for_dev_shm_is_refused_with_a_way_out(monkeypatch):
    import shutil

    from miles_plugin_tensor import handoff

    usage = shutil.disk_usage("/dev/shm")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    pool = handoff.SegmentPool()
    with pytest.raises(MilesError, match=r"does not fit in /dev/shm.*transport.bucket_mb"):
        handoff.shm_payload(pool, 0, list(Policy().named_weights()), adopt=True)
    pool.close()
