"""miles plugin: ``run.mode: async``. Rollout workers stream finished groups into a bounded
buffer that the trainer drains at its own pace, and each step's new weights reach the engines
in the background while generation goes on.

Only hooks live here; the mode (``mode``) and its rollout workers (``streamer``) are imported
when a run builds the mode, so discovering plugins stays cheap.
"""
from miles import hookimpl


@hookimpl
def miles_register_modes(register):
    from .config import AsyncConfig

    register("async", _make, config=AsyncConfig)


def _make(cfg, *, ctx, **_):
    from .mode import AsyncMode

    return AsyncMode(cfg, ctx)


@hookimpl
def miles_validate_config(config):
    """``rollout.in_flight: resume`` aborts and resumes requests at each push: only engines in
    their own processes can (a launcher's engine workers, or an SGLang client)."""
    mode = config.mode_settings
    if config.run.mode != "async" or mode is None or mode.in_flight != "resume":
        return None
    if config.name("engine") == "torch" and not config.name("launcher"):
        return ["rollout.in_flight: resume needs engines in their own processes that abort and resume "
                "requests (launcher.engines >= 1, or engine.name: sglang); engine 'torch' here runs in "
                "the trainer's process and cannot: set rollout.in_flight: finish"]
    return None
