"""Command ``miles dashboard [RUN_DIR ...]``: a local web page that follows runs while they train;
logger ``prometheus``: a trainer's step metrics on ``/metrics`` of a port of its own (rank 0).

Registration imports nothing heavy: FastAPI and uvicorn load when the dashboard starts,
prometheus_client when the logger is made.
"""
from typing import Any

from miles import hookimpl


@hookimpl
def miles_register_commands(register: Any) -> None:
    from .command import add_arguments, run

    register("dashboard", "follow runs live in a local web page (curves, step timeline, samples, engines, devices)",
             add_arguments, run)


@hookimpl
def miles_register_loggers(register: Any) -> None:
    from .prometheus import PrometheusConfig, make_logger

    register("prometheus", make_logger, config=PrometheusConfig)
