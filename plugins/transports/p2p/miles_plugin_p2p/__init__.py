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


@hookimpl
def miles_validate_config(config):
    """p2p writes into engines of other processes; the in-process torch engine (no launcher, or
    launcher.engines: 0) has no endpoint to write to: told with the config, before anything is written."""
    if config.name("transport") != "p2p" or config.name("engine") != "torch":
        return None
    if config.name("launcher") is not None and getattr(config.settings("launcher"), "engines", 0) > 0:
        return None
    return ["transport.name: p2p writes into engine processes, but this run's engine is inside the trainer; "
            "use `miles serve` workers (launcher.name: local with launcher.engines >= 1, or engine.name: sglang), "
            "or transport.name: tensor for an in-process engine"]
