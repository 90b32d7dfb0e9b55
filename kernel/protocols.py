"""Protocols of the named components. Plugins implement them; the kernel loop only talks to these.

Each kind is registered by its ``miles_register_<kind>s`` hook as ``register(name, factory,
config=PydanticModel)``; the kernel validates the component's config section (minus ``name``) with
that model and calls ``factory(config, **context)`` with the keyword context listed on each protocol.
"""
from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Protocol, Sequence,
                    runtime_checkable)

from .types import Batch, Completion, Group, SamplingParams, Sample, Task

if TYPE_CHECKING:  # pragma: no cover
    import torch

LossFn = Callable[[Batch, "torch.Tensor"], "tuple[torch.Tensor, dict[str, float]]"]


@runtime_checkable
class ModelSpec(Protocol):
    """Builds a model architecture. Factory context: none.

    ``build_tokenizer(default)``: the tokenizer (``default`` is the env's, if it offers one);
    ``build_model(tokenizer)``: a fresh ``torch.nn.Module`` causal LM with HF-style
    ``forward(input_ids, attention_mask, position_ids) -> .logits`` and HF parameter names.
    Optional: ``sync_filter(name) -> bool``: the weights training changes (e.g. LoRA adapters);
    after the first, full sync the loop sends engines only those; ``save_pretrained(named,
    tokenizer, path)``: ``miles export`` writes a Hugging Face folder through it.
    """

    def build_tokenizer(self, default: Any = None) -> Any: ...
    def build_model(self, tokenizer: Any) -> "torch.nn.Module": ...


@runtime_checkable
class Env(Protocol):
    """Tasks and their verifier. Factory context: ``seed``.

    ``tasks(split)``: the tasks of ``"train"`` or ``"eval"``; ``reward(sample)``: the verifier's
    score. Optional: ``tokenizer()`` (a default tokenizer for the model spec) and
    ``demonstrations()`` (``(task, response_text)`` pairs for supervised training).
    """

    def tasks(self, split: str) -> Sequence[Task]: ...
    def reward(self, sample: Sample) -> float: ...


@runtime_checkable
class Engine(Protocol):
    """Rollout engine. Factory context: ``spec`` (ModelSpec), ``tokenizer``, ``seed``.

    ``generate(prompts, params, n)`` returns, for each prompt, ``n`` completions with per-token
    log-probs. ``load_weights(named_tensors, version)`` replaces the weights (HF names) and sets
    ``weight_version``. An engine starts without usable weights: the loop syncs them first.
    ``tokenizer`` is the run's tokenizer; ``sampling_params`` the run's rollout settings (set by
    the loop, read by rollout hooks). Optional: ``score(batch, logprob_fn) -> [B, R]``: the
    engine's log-probs of a training batch by ``logprob_fn(model, batch)`` on its own weights
    (``rollout.true_on_policy``). Optional: ``pause_generation(mode="abort")`` and
    ``continue_generation()`` (SGLang's semantics), called around each weight push of an async run
    with ``rollout.in_flight: resume``: ``generate`` calls cut short by the pause go on from their
    tokens so far on the new weights, one ``Completion.weight_versions`` entry per segment.
    """

    weight_version: int
    tokenizer: Any
    sampling_params: SamplingParams

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 n: int = 1) -> list[list[Completion]]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], version: int) -> None: ...


@runtime_checkable
class Trainer(Protocol):
    """Owns the policy (and reference) model and its optimizer. Factory context: ``spec``,
    ``tokenizer``, ``seed``, ``total_steps``.

    ``logprobs(batch, which)``: no-grad log-probs ``[B, R]`` of the response tokens under ``which``
    in ``{"policy", "ref"}``; ``train_step(batch, loss_fn)``: one optimizer step over the batch
    (micro-batched), returns averaged metrics; ``snapshot_reference()``: freeze the current policy as
    the reference model; ``load_weights(named)``: set the policy's weights (HF names);
    ``named_weights()``: full weights in HF names (an iterator, so a sharded trainer can stream them);
    ``save(dir)``/``load(dir)``: full training state. Optional, for an ``algorithm`` (factory
    context) with ``needs_critic``: ``values(batch)``: no-grad ``[B, R]`` critic values (``V_t``: the
    state before response token ``t``); ``train_critic(batch, value_loss_fn)``: one critic optimizer
    step on ``value_loss_fn(batch, values) -> (loss, metrics)``, returns metrics. Optional:
    ``response_logprobs(model, batch)``: the exact routine ``train_step`` scores with;
    ``rollout.true_on_policy`` has the engine apply it to the engine's weights.
    """

    def logprobs(self, batch: Batch, which: str = "policy") -> "torch.Tensor": ...
    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]: ...
    def snapshot_reference(self) -> None: ...
    def load_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None: ...
    def named_weights(self) -> Iterator[tuple[str, "torch.Tensor"]]: ...
    def save(self, path: str) -> None: ...
    def load(self, path: str) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """Moves weights from the trainer to engines. Factory context: ``out_dir``.

    ``sync(trainer, engines, version)`` pushes ``trainer.named_weights()`` and returns metrics
    (at least ``weight_sync_seconds`` and ``weight_sync_bytes``).
    """

    def sync(self, trainer: Trainer, engines: Sequence[Engine], version: int) -> dict[str, float]: ...


@runtime_checkable
class Algorithm(Protocol):
    """Turns groups into a loss. Factory context: none.

    ``uses_rollout``: False for supervised algorithms (batches come from ``env.demonstrations()``);
    ``needs_reference``: the loop asks the trainer for ``ref_logprobs``;
    ``keep(group)``: the algorithm's own filter (e.g. drop zero-variance groups);
    ``advantages(groups)``: per group, per sample a float or a per-token list;
    ``loss(batch, logprobs)``: this micro-batch's share of the loss (see ``Batch.token_mean``).
    Optional: ``prepare(batch) -> metrics``, called once per step on the whole batch after its
    ref/old log-probs (and critic values) are filled, before any optimizer step (token-level
    advantages: KL in the reward, GAE, batch whitening); ``needs_critic``: the loop puts
    ``trainer.values(batch)`` in ``batch.extras["values"]`` and, after each policy step, calls
    ``trainer.train_critic(minibatch, algorithm.value_loss)``.
    Optional: ``supervised_samples(tokenizer, count, rng, version) -> list[Sample] | None``: a
    supervised algorithm's own examples (e.g. a dataset file) instead of the env's demonstrations;
    ``make_batch(samples, pad_id, advantages) -> Batch``: its own batch layout (e.g. SFT's packed
    rows with a 4-D block-diagonal ``attention_mask``) instead of ``Batch.from_samples``.
    """

    uses_rollout: bool
    needs_reference: bool

    def keep(self, group: Group) -> bool: ...
    def advantages(self, groups: Sequence[Group]) -> list[list[Any]]: ...
    def loss(self, batch: Batch, logprobs: "torch.Tensor") -> "tuple[torch.Tensor, dict[str, float]]": ...


@runtime_checkable
class Mode(Protocol):
    """How rollout and training interleave (``run.mode``). Factory context: ``loop`` (the run's
    ``miles.loop.Loop``: a mode reads its ``cfg``, ``pm``, ``p`` (the components), ``version``,
    ``seed``, ``main``, ``params`` and ``train_tasks``, and calls ``rollout``, ``keep``, ``console``).
    Built by ``Loop.build`` on every trainer rank, once the other components exist.

    ``take(rng, params)``: rank 0, once per RL step: the step's kept groups and its rollout
    metrics (at least ``reward_mean``, ``groups_kept``, ``groups_dropped``, ``rollout_seconds``);
    on ``EngineRestarted`` every rank pushes the weights again, then ``take`` is asked again.
    ``push(trainer, engines, version, wait)``: every rank: the trainer's weights to the engines
    as ``version`` through the run's transport; returns its metrics with the engines holding the
    weights, unless ``wait=False`` (the push after a training step) lets the mode finish it later.
    ``finish_push()`` (before an evaluation, before the next push and at the end of the run)
    waits for such a push and returns its metrics (``{}`` when none was pending).
    ``reweight(batch, logprobs)``: every rank, in each loss call: the batch the loss sees and
    extra metrics (e.g. importance weights of samples from older weights). ``lock_engines()``: a
    context manager the loop holds around each use of the engines (rollout, scoring).
    ``close()``: at the end of the run, also after an error.
    """

    def take(self, rng: Any, params: SamplingParams) -> tuple[list[Group], dict[str, Any]]: ...

    def push(self, trainer: Trainer, engines: Sequence[Engine], version: int,
             wait: bool = True) -> dict[str, float]: ...

    def finish_push(self) -> dict[str, float]: ...
    def reweight(self, batch: Batch, logprobs: "torch.Tensor") -> tuple[Batch, dict[str, float]]: ...
    def lock_engines(self) -> ContextManager[Any]: ...
    def close(self) -> None: ...


@runtime_checkable
class Launcher(Protocol):
    """Places and supervises the processes of a run. Factory context: none.

    ``launch(config, pm, plugins)`` runs the whole job and returns its exit code: it starts
    trainer ranks (``miles train`` with torchrun-style ``RANK``/``WORLD_SIZE``/``MASTER_*`` and
    ``MILES_LAUNCHED=1``, so they run the loop instead of launching again) and engine workers,
    turns a dead child into an error that names it, and leaves no process behind on success,
    failure or Ctrl-C. ``plugins``: launch-time plugin modules the children must load too.
    """

    def launch(self, config: Any, pm: Any, plugins: list[str]) -> int: ...


@runtime_checkable
class Logger(Protocol):
    """Metric sink. Factory context: ``out_dir``, ``total_steps``."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...
    def close(self) -> None: ...
