"""Launcher ``local``: trainer ranks and engine workers as supervised processes on one machine."""
from miles import hookimpl


@hookimpl
def miles_register_launchers(register):
    from .config import LocalLauncherConfig

    register("local", _make, config=LocalLauncherConfig)


def _make(cfg, **_):
    from .launcher import LocalLauncher

    return LocalLauncher(cfg)
