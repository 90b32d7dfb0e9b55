"""The plugin registers run mode ``async`` without importing torch, and it satisfies the
kernel's ``Mode`` protocol like the built-in ``sync``."""
from types import SimpleNamespace

from miles.builtin import SyncMode
from miles.config import RolloutConfig
from miles.protocols import Mode
from miles.testing import assert_lazy_registration
from miles_plugin_async.mode import AsyncMode


def test_registration_is_lazy():
    assert_lazy_registration("miles_plugin_async", "modes", "async")


def test_both_modes_follow_the_protocol():
    loop = SimpleNamespace(cfg=SimpleNamespace(rollout=RolloutConfig()), p=SimpleNamespace(engine=None))
    for mode in (SyncMode(loop=loop), AsyncMode(loop)):
        assert isinstance(mode, Mode)
        assert mode.finish_push() == {}  # nothing pending
        mode.resynced()
        mode.close()
