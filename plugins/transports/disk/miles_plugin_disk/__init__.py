"""Transport ``disk``: the trainer writes each weight version as safetensors shards, engines read them.

Registration stays torch-free; ``load_version``/``read_manifest`` (used by ``miles serve`` to reload
from disk) resolve lazily on first access.
"""
from miles import hookimpl


@hookimpl
def miles_register_transports(register):
    from .config import DiskSyncConfig

    register("disk", _make, config=DiskSyncConfig)


def _make(cfg, *, out_dir=None, **_):
    from .transport import DiskTransport

    return DiskTransport(cfg, out_dir=out_dir)


def __getattr__(name):
    if name in ("load_version", "read_manifest"):
        from . import reader

        return getattr(reader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
