"""The kernel's default plugin, registered through the same hooks as any other (pytest's and llm's
default plugins work the same way): the run mode ``sync``, the rollout ``single_turn`` with its
``trylast`` ``miles_rollout`` default, and the ``jsonl`` metric sink (``metrics.jsonl``, which
every run writes). Every run uses them unless its config names others."""
from __future__ import annotations

from typing import Any

from miles_tokens import decode_batch, encode_prompts  # noqa: F401  (public names of miles.builtin too)

from .hookspecs import hookimpl
from .types import Sample, SamplingParams, Task


@hookimpl
def miles_register_loggers(register: Any) -> None:
    from .runfolder import MetricsLog

    register("jsonl", MetricsLog)  # what the run writes anyway: metrics.jsonl


@hookimpl
def miles_register_modes(register: Any) -> None:
    from .modes import SyncMode

    register("sync", SyncMode)


@hookimpl
def miles_register_rollouts(register: Any) -> None:
    from .rollouts import SingleTurn

    register("single-turn", SingleTurn)


@hookimpl(trylast=True)
def miles_rollout(task: Task, n: int, engine: Any, tokenizer: Any, params: SamplingParams) -> list[Sample]:
    """Default: one single-turn generation of ``n`` samples, for callers outside a run (a run sends
    the tasks no other hook claims to its ``rollout.name`` component, batched, instead)."""
    from .rollouts import single_turn

    return single_turn([task], n, engine, tokenizer, params)[0]
