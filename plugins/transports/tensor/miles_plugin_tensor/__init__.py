"""Transport ``tensor``: colocated weight hand-off (trainer and engine in one process)."""
from miles import hookimpl


@hookimpl
def miles_register_transports(register):
    from .transport import TensorSyncConfig

    register("tensor", _make, config=TensorSyncConfig)


def _make(cfg, **_):
    from .transport import TensorTransport

    return TensorTransport(cfg)
