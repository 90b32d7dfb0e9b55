"""Command ``miles serve MODEL_DIR``: the argument parsing and access policy (API key) in front of
the ``miles_serve`` hook, which an engine plugin implements (the torch engine's by default)."""
from typing import Any

from miles import hookimpl


@hookimpl
def miles_register_commands(register: Any) -> None:
    from .command import add_arguments, run

    register("serve", "serve a Hugging Face model folder over SGLang's HTTP API", add_arguments, run)
