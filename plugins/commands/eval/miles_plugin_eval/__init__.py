"""Command ``miles eval CONFIG [--samples N] [--k K] [--show N] [key=value ...]``: the newest intact
checkpoint in ``run.out_dir`` evaluated on the env's eval split (greedy, or N samples per prompt
for pass@k and maj@k), printed as one JSON line."""
from typing import Any

from miles import hookimpl


@hookimpl
def miles_register_commands(register: Any) -> None:
    from .command import add_arguments, run

    register("eval", "evaluate the newest checkpoint of a run", add_arguments, run)
