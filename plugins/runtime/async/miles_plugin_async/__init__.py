"""miles plugin: ``run.mode: async``. Rollout workers stream finished groups into a bounded
buffer that the trainer drains at its own pace, and each step's new weights reach the engines
in the background while generation goes on.

Only the registration hook lives here; the mode (``mode``) and its rollout workers
(``streamer``) are imported when a run builds the mode, so discovering plugins stays cheap.
"""
from miles import hookimpl


@hookimpl
def miles_register_modes(register):
    register("async", _make)


def _make(cfg, *, loop, **_):
    from .mode import AsyncMode

    return AsyncMode(loop)
