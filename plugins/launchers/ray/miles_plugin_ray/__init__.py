"""Launcher ``ray``: trainer ranks and engine servers as Ray actors on one or many machines."""
from miles import hookimpl


@hookimpl
def miles_register_launchers(register):
    from .config import RayLauncherConfig

    register("ray", _make, config=RayLauncherConfig)


def _make(cfg, **_):
    from .launcher import RayLauncher

    return RayLauncher(cfg)
