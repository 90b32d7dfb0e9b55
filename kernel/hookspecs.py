"""The extension surface of miles: every hook a plugin may implement.

A hookimpl may accept any subset of a hook's arguments (pluggy's rule), so hooks can gain
arguments later without breaking plugins. Mark implementations with ``@miles.hookimpl``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

from .types import Group, Sample, Task

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .protocols import Engine, Env
    from .types import Batch

hookspec = pluggy.HookspecMarker("miles")
hookimpl = pluggy.HookimplMarker("miles")

Register = Callable[..., None]


# --- per-run hooks -------------------------------------------------------------------------------

@hookspec(firstresult=True)
def miles_reward(sample: Sample) -> float | None:
    """Score one finished sample, overriding the environment's verifier.

    Called once per sample after rollout, before grouping. firstresult: the first non-None
    return wins; return ``None`` to say "not mine" and let the next plugin (and finally the
    environment's own ``reward``) decide.
    """


@hookspec
def miles_filter(group: Group) -> bool | None:
    """Decide whether a group of samples is kept for training (dynamic sampling).

    Called for every group after rewards are set; every implementation is called. The group is
    dropped when any implementation returns ``False``; ``True`` or ``None`` keep it. Dropped
    groups are counted in the step's ``groups_dropped`` metric.
    """


@hookspec(firstresult=True)
def miles_loss(batch: "Batch", logprobs: "torch.Tensor") -> "tuple[torch.Tensor, dict[str, float]] | None":
    """Replace the algorithm's policy loss.

    Called for every micro-batch of every optimizer step. ``logprobs`` ``[B, R]`` are the current
    policy's log-probabilities of the response tokens (they require grad); ``batch`` carries
    ``loss_mask``, ``advantages``, ``rollout_logprobs`` and friends (see ``miles.Batch``). Return
    ``(loss, metrics)`` where ``loss`` is this micro-batch's share of the step loss (use
    ``batch.token_mean`` / ``batch.seq_mean``); metrics are averaged and logged with the step.
    firstresult: ``None`` means "use the algorithm's loss".
    """


@hookspec(firstresult=True)
def miles_rollout(task: Task, n: int, engine: "Engine", env: "Env") -> list[Sample] | None:
    """Generate the ``n`` samples of one task (multi-turn, agents, tools).

    Called once per task of each rollout batch. firstresult: return the samples (rewards may be
    left ``None`` for the env / ``miles_reward`` to fill); ``None`` means "not mine". The
    built-in single-turn rollout is the ``trylast`` default (the loop batches all tasks that fall
    through to it into one engine call).
    """


@hookspec
def miles_on_step_end(step: int, metrics: dict[str, Any]) -> None:
    """Observe every finished training step.

    Called after the step's metrics (including any evaluation at that step) are complete and
    logged. Every implementation is called; return values are ignored.
    """


@hookspec(firstresult=True)
def miles_serve(model_dir: str, host: str, port: int, api_key: str | None, settings: dict[str, Any]) -> int | None:
    """Serve the model in ``model_dir`` (a Hugging Face folder) over HTTP with SGLang's native API.

    Called once by ``miles serve MODEL_DIR``; ``settings`` are its ``key=value`` arguments (YAML
    values), for the serving plugin to validate. The implementation blocks until SIGTERM/SIGINT,
    prints ``miles serve: listening on http://HOST:PORT`` once requests are accepted, and returns
    the exit code. firstresult: ``None`` means "not mine"; the torch engine plugin is the
    ``trylast`` default.
    """


# --- registration hooks --------------------------------------------------------------------------

@hookspec
def miles_register_engines(register: Register) -> None:
    """Register rollout engines: ``register(name, factory, config=Model)``. Called once per
    plugin manager; see ``miles.protocols.Engine`` for the factory's context."""


@hookspec
def miles_register_trainers(register: Register) -> None:
    """Register training backends: ``register(name, factory, config=Model)``. Called once;
    see ``miles.protocols.Trainer``."""


@hookspec
def miles_register_transports(register: Register) -> None:
    """Register weight-sync transports: ``register(name, factory, config=Model)``. Called once;
    see ``miles.protocols.Transport``."""


@hookspec
def miles_register_algorithms(register: Register) -> None:
    """Register RL / supervised algorithms: ``register(name, factory, config=Model)``. Called
    once; see ``miles.protocols.Algorithm``."""


@hookspec
def miles_register_envs(register: Register) -> None:
    """Register environments: ``register(name, factory, config=Model)``. Called once;
    see ``miles.protocols.Env``."""


@hookspec
def miles_register_model_specs(register: Register) -> None:
    """Register model specs: ``register(name, factory, config=Model)``. Called once;
    see ``miles.protocols.ModelSpec``."""


@hookspec
def miles_register_launchers(register: Register) -> None:
    """Register launchers (process placement and supervision): ``register(name, factory,
    config=Model)``. Called once."""


@hookspec
def miles_register_loggers(register: Register) -> None:
    """Register metric sinks: ``register(name, factory, config=Model)``. Called once;
    see ``miles.protocols.Logger``."""


@hookspec
def miles_register_modes(register: Register) -> None:
    """Register run modes, selected by ``run.mode``: ``register(name, factory)``. Called once;
    see ``miles.protocols.Mode``. The kernel registers ``sync``; ``async`` comes from the
    ``miles-plugin-async`` distribution."""
