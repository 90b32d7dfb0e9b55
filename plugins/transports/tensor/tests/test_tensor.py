import pytest
import torch

from miles import MilesError
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
