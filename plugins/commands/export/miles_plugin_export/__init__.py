"""Command ``miles export RUN_DIR --to FOLDER``: a run's newest intact checkpoint as a Hugging Face
model folder (config, safetensors, tokenizer), written by the model spec (``miles.protocols.Exports``)."""
from typing import Any

from miles import hookimpl


@hookimpl
def miles_register_commands(register: Any) -> None:
    from .command import add_arguments, run

    register("export", "write a run's newest checkpoint as a Hugging Face folder", add_arguments, run)
