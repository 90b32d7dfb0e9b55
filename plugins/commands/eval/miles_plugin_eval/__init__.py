"""Command ``miles eval CONFIG [key=value ...]``: the run's evaluation (greedy, on the env's eval
split) of the newest intact checkpoint in ``run.out_dir``, printed as one JSON line."""
from typing import Any

from miles import hookimpl


@hookimpl
def miles_register_commands(register: Any) -> None:
    from .command import add_arguments, run

    register("eval", "evaluate the newest checkpoint of a run", add_arguments, run)
