"""Transport ``p2p``: engines register their weight memory with a NIXL agent and publish it
(``p2p_open``); the trainer writes every bucket straight into it and commits a version."""
from miles import hookimpl


@hookimpl
def miles_register_transports(register):
    from .config import P2PSyncConfig

    register("p2p", _make, config=P2PSyncConfig)


def _make(cfg, **_):
    from .transport import P2PTransport

    return P2PTransport(cfg)
