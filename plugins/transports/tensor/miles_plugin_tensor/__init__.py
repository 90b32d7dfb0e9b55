"""Transport ``tensor``: colocated weight hand-off. An engine in the trainer's process gets the
tensors by reference; an engine process on the same host gets them through POSIX shared memory
(CPU) or CUDA IPC handles (GPU)."""
from miles import hookimpl


@hookimpl
def miles_register_transports(register):
    from .config import TensorSyncConfig

    register("tensor", _make, config=TensorSyncConfig)


def _make(cfg, **_):
    from .transport import TensorTransport

    return TensorTransport(cfg)
