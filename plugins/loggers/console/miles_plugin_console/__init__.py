"""Logger ``console``: one line per step, and progress with ETA for long phases (the default logger).

Registration imports nothing heavy; rich loads when the logger is made.
"""
from typing import Any

from miles import hookimpl


@hookimpl
def miles_register_loggers(register: Any) -> None:
    from .config import ConsoleConfig

    register("console", _make, config=ConsoleConfig)


def _make(cfg: Any, *, total_steps: int = 0, **_: Any) -> Any:
    from .logger import ConsoleLogger

    return ConsoleLogger(cfg, total_steps=total_steps)
