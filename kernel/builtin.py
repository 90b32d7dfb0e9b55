"""Built-in defaults, registered through the same hooks as any plugin: the ``jsonl`` metric sink
(``metrics.jsonl``, which every run writes). The default run mode and rollout are plugins of their
own: ``miles-plugin-sync`` (``run.mode: sync``), ``miles-plugin-single-turn`` (``single_turn``)."""
from __future__ import annotations

from typing import Any

from miles_runfolder import MetricsLog
from miles_tokens import decode_batch, encode_prompts  # noqa: F401  (public names of miles.builtin too)

from .hookspecs import hookimpl


@hookimpl
def miles_register_loggers(register: Any) -> None:
    register("jsonl", MetricsLog)  # what the run writes anyway: metrics.jsonl
