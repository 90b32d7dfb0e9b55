"""The extension surface of miles: every hook a plugin may implement.

A hookimpl may accept any subset of a hook's arguments (pluggy's rule), so hooks can gain
arguments later without breaking plugins. Mark implementations with ``@miles.hookimpl``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

from .types import Group, Sample, SamplingParams, Task

if TYPE_CHECKING:  # pragma: no cover (names for annotations only: no torch at import, no import cycle)
    import torch

    from .config import Config
    from .plugins import MilesPluginManager
    from .protocols import Engine, Env, RegisterCommand, RegisterComponent, RunContext
    from .types import Batch

hookspec = pluggy.HookspecMarker("miles")
hookimpl = pluggy.HookimplMarker("miles")


# --- per-run hooks -------------------------------------------------------------------------------

@hookspec(firstresult=True)
def miles_reward(sample: Sample) -> float | None:
    """Score one finished sample (called once, after rollout, before grouping), overriding the
    environment's verifier. firstresult: the first non-None return wins; return ``None`` to say
    "not mine" and let the next plugin (and finally the environment's own ``reward``) decide."""


@hookspec
def miles_filter(group: Group) -> bool | None:
    """Decide whether a group of samples is kept for training (dynamic sampling); called for
    every group after rewards are set, every implementation. The group is dropped when any returns
    ``False`` (``True`` or ``None`` keep it), and counted in the step's ``groups_dropped`` metric."""


@hookspec(firstresult=True)
def miles_loss(batch: "Batch", logprobs: "torch.Tensor") -> "tuple[torch.Tensor, dict[str, float]] | None":
    """Replace the algorithm's policy loss; called for every micro-batch of every optimizer
    step. ``logprobs`` ``[B, R]`` are the current policy's log-probabilities of the response
    tokens (they require grad); ``batch`` carries ``loss_mask``, ``advantages``,
    ``rollout_logprobs`` and friends (see ``miles.Batch``). Return ``(loss, metrics)`` where
    ``loss`` is this micro-batch's share of the step loss (use ``batch.token_mean`` /
    ``batch.seq_mean``); metrics are averaged and logged with the step. firstresult: ``None``
    means "use the algorithm's loss"."""


@hookspec(firstresult=True)
def miles_rollout(task: Task, n: int, engine: "Engine", env: "Env", tokenizer: Any,
                  params: "SamplingParams") -> list[Sample] | None:
    """Generate the ``n`` samples of one task (multi-turn, agents, tools): called once per task
    of each rollout batch, with the run's tokenizer and this rollout's sampling params.
    firstresult: return the samples (rewards may be left ``None`` for the env / ``miles_reward``
    to fill); ``None`` means "not mine". The ``trylast`` default comes with the kernel's
    ``single-turn`` rollout (``miles.builtin``); a run leaves it out and batches every task no hook
    claims into one call of its ``rollout.name`` component instead."""


@hookspec(firstresult=True)
def miles_warm_start(run: "RunContext", settings: dict[str, Any]) -> bool | None:
    """Run the supervised warm start (``run.warm_start``) before the first RL step.

    Called once on every trainer rank of a run that has ``run.warm_start`` and no checkpoint yet;
    ``settings`` are that section as given, which the implementing plugin validates (and checks
    beforehand in ``miles_validate_warm_start``). ``run`` is the run
    (``miles.protocols.RunContext``): the phase trains the trainer ``run.new_trainer(settings=,
    algorithm=, total_steps=)`` makes with ``run.update``, pushes and evaluates with
    ``run.publish``/``run.evaluate``, stops when ``run.stopping()``. Return ``True`` when done:
    the run's trainer starts from its weights. firstresult: ``None`` means "not mine";
    ``miles-plugin-sft`` implements it.
    """


@hookspec(firstresult=True)
def miles_validate_warm_start(settings: dict[str, Any], pm: "MilesPluginManager") -> list[str] | None:
    """Check ``run.warm_start`` (``settings``, the section as given); called once per run that has
    it, with the rest of the config, before anything is built. The plugin that runs the warm start
    owns its keys and returns every problem, each starting with ``run.warm_start.<key>`` (``[]``:
    none). firstresult: ``None`` means "not mine"."""


@hookspec
def miles_on_step_end(step: int, metrics: dict[str, Any]) -> None:
    """Observe every finished training step, once its metrics (with any evaluation at that step)
    are complete and logged. Every implementation is called; return values are ignored."""


@hookspec(firstresult=True)
def miles_serve(model_dir: str, host: str, port: int, api_key: str | None, settings: dict[str, Any]) -> int | None:
    """Serve the model in ``model_dir`` (a Hugging Face folder) over HTTP with SGLang's native API.

    Called once by ``miles serve MODEL_DIR``; ``settings`` are its ``key=value`` arguments (YAML
    values), for the serving plugin to validate. The implementation blocks until SIGTERM/SIGINT,
    prints ``miles serve: listening on http://HOST:PORT`` once requests are accepted, and returns
    the exit code. firstresult: ``None`` means "not mine"; the torch engine plugin is the
    ``trylast`` default.
    """


# --- registration hooks: each is called once per plugin manager with ``register(name, factory,
# config=PydanticModel)`` (``miles.protocols.RegisterComponent``); the protocol of each kind lists
# the context its factory receives -----------------------------------------------------------------

@hookspec
def miles_register_engines(register: "RegisterComponent") -> None:
    """Register rollout engines (``miles.protocols.Engine``); called once."""


@hookspec
def miles_register_trainers(register: "RegisterComponent") -> None:
    """Register training backends (``miles.protocols.Trainer``); called once."""


@hookspec
def miles_register_transports(register: "RegisterComponent") -> None:
    """Register weight-sync transports (``miles.protocols.Transport``); called once."""


@hookspec
def miles_register_algorithms(register: "RegisterComponent") -> None:
    """Register RL and supervised algorithms (``miles.protocols.Algorithm``); called once."""


@hookspec
def miles_register_envs(register: "RegisterComponent") -> None:
    """Register environments (``miles.protocols.Env``); called once."""


@hookspec
def miles_register_model_specs(register: "RegisterComponent") -> None:
    """Register model specs (``miles.protocols.ModelSpec``); called once."""


@hookspec
def miles_register_launchers(register: "RegisterComponent") -> None:
    """Register launchers, which place and supervise processes (``miles.protocols.Launcher``); called once."""


@hookspec
def miles_register_loggers(register: "RegisterComponent") -> None:
    """Register metric sinks (``miles.protocols.Logger``); called once."""


@hookspec
def miles_register_modes(register: "RegisterComponent") -> None:
    """Register run modes, selected by ``run.mode`` (``miles.protocols.Mode``); called once
    (``sync``: the kernel's, ``miles.builtin``; ``async``: ``miles-plugin-async``)."""


@hookspec
def miles_register_rollouts(register: "RegisterComponent") -> None:
    """Register rollout components, selected by ``rollout.name`` (``miles.protocols.Rollout``);
    called once (``single-turn``, the default: the kernel's, ``miles.builtin``)."""


@hookspec
def miles_register_architectures(register: "RegisterComponent") -> None:
    """Register model families' specifics (``miles.protocols.Architecture``), one per Hugging Face
    ``model_type`` (the name; ``factory(None)`` makes it); called once. Model specs look up their
    model's type here, and a family plugin adds an architecture without touching any other code."""


@hookspec
def miles_validate_config(config: "Config", pm: "MilesPluginManager") -> list[str] | None:
    """Check settings across sections, before anything is built.

    Called once per run with the resolved ``miles.config.Config`` (every section already valid on
    its own) and the run's plugin manager. Every implementation is called; each returns problems
    (strings that start with the key they are about, e.g. ``"rollout.in_flight: ..."``) or None.
    They are reported together with every other config problem.
    """


@hookspec
def miles_register_commands(register: "RegisterCommand") -> None:
    """Register ``miles <name>`` subcommands: ``register(name, help, add_arguments, run)``, where
    ``add_arguments(parser)`` adds the command's arguments to its ``argparse`` parser and
    ``run(args) -> int`` runs it and returns the exit code (a ``MilesError`` it raises is printed
    without a traceback). Called once when the command line is parsed; a name that is already a
    command is an error."""
