"""Transport ``broadcast``: trainer rank 0 and the engines form a torch.distributed group of their
own (gloo on CPU, NCCL on GPU) and every bucket of weights is broadcast from rank 0."""
from miles import hookimpl


@hookimpl
def miles_register_transports(register):
    from .config import BroadcastSyncConfig

    register("broadcast", _make, config=BroadcastSyncConfig)


def _make(cfg, **_):
    from .transport import BroadcastTransport

    return BroadcastTransport(cfg)
