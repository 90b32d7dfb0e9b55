"""miles plugin: ``run.mode: sync``, the default run mode. Each step rolls out, trains and pushes
the new weights, in that order, so every sample is exactly on-policy.

Only the registration hook lives here; the mode is in ``mode``.
"""
from miles import hookimpl


@hookimpl
def miles_register_modes(register):
    register("sync", _make)


def _make(cfg, *, ctx, **_):
    from .mode import SyncMode

    return SyncMode(cfg, ctx=ctx)
