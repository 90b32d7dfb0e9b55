"""Every contract between components. Plugins implement them; the kernel loop only talks to these.

A component is made as ``factory(settings, **context)`` (``miles.hookspecs``' registration hooks)
with the keyword context listed on its protocol, and receives what it needs there or per call;
nothing sets attributes on another component. Optional capabilities are small protocols of their
own, checked with ``isinstance`` (e.g. ``ReceivesWeights``, ``Distributed``).
"""
from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Protocol, Sequence,
                    runtime_checkable)

from .types import Batch, Completion, Group, SamplingParams, Sample, Task

if TYPE_CHECKING:  # pragma: no cover (annotations only: no torch at import, no import cycle)
    import threading

    import torch

    from .config import Config
    from .plugins import MilesPluginManager

LossFn = Callable[[Batch, "torch.Tensor"], "tuple[torch.Tensor, dict[str, float]]"]
Named = Iterable[tuple[str, "torch.Tensor"]]


# --- model specs ----------------------------------------------------------------------------------
@runtime_checkable
class ModelSpec(Protocol):
    """Builds a model architecture. Factory context: ``pm`` (the run's plugin manager, so a spec
    that wraps another, like ``lora``, resolves it with the run's launch-time plugins too).

    ``build_tokenizer(default)``: the tokenizer (``default`` is the env's, if it offers one);
    ``build_model(tokenizer)``: a fresh ``torch.nn.Module`` with Hugging Face parameter names; for
    a causal LM, HF-style ``forward(input_ids, attention_mask, position_ids) -> .logits``.
    Backends may ask a spec for more, each optional and a protocol below (``EditsMegatronLayers``,
    ``Exports``, ``ScoresActions``, ...).
    """

    def build_tokenizer(self, default: Any = None) -> Any: ...
    def build_model(self, tokenizer: Any) -> "torch.nn.Module": ...


@runtime_checkable
class SyncFilter(Protocol):
    """A spec whose training changes only some weights (e.g. LoRA adapters): after the first, full
    sync the loop sends engines only the weights ``sync_filter(name)`` accepts."""

    def sync_filter(self, name: str) -> bool: ...


@runtime_checkable
class Exports(Protocol):
    """``miles export`` writes a Hugging Face folder (config, safetensors, tokenizer) through
    ``save_pretrained(named, tokenizer, path)``; ``path`` does not exist yet and is the caller's."""

    def save_pretrained(self, named: Named, tokenizer: Any, path: str) -> None: ...


@runtime_checkable
class EditsMegatronLayers(Protocol):
    """A spec that changes the megatron trainer's transformer layer: ``megatron_layer_spec(layer_spec)
    -> layer_spec`` gets megatron-core's ``ModuleSpec`` of one layer and returns it with any
    submodule swapped (e.g. another core attention)."""

    def megatron_layer_spec(self, layer_spec: Any) -> Any: ...


@runtime_checkable
class ScoresActions(Protocol):
    """A spec whose model is not a causal LM (e.g. a diffusion transformer) says how a trainer
    scores a batch: ``action_logprobs(model, batch) -> [B, T]``, the log-probability of each
    action (``Batch``'s docstring) under ``model``, differentiable. Trainers use it instead of
    their causal-LM routine."""

    def action_logprobs(self, model: "torch.nn.Module", batch: Batch) -> "torch.Tensor": ...


@runtime_checkable
class KeepsTrainingState(Protocol):
    """A spec with training state beside the model's weights (e.g. an EMA of them), kept in the
    trainer's checkpoints: ``training_state(model)``: its tensors for ``model`` by name, sharded as
    the model (empty: none yet); ``load_training_state(model, state)``: them back, as full tensors."""

    def training_state(self, model: "torch.nn.Module") -> dict[str, "torch.Tensor"]: ...
    def load_training_state(self, model: "torch.nn.Module", state: dict[str, "torch.Tensor"]) -> None: ...


@runtime_checkable
class DiffusionSpec(Protocol):
    """A spec of a diffusion transformer, as a diffusion engine builds on it: ``text_encoder(tokenizer)``
    (a module of prompt embeddings), ``max_length()`` (prompt tokens), ``image_size(model)``,
    ``vae_factor()`` (pixels per latent side) and ``decode(latents)`` (images ``[B, 3, H, W]`` in [0, 1])."""

    def text_encoder(self, tokenizer: Any) -> "torch.nn.Module": ...
    def max_length(self) -> int: ...
    def image_size(self, model: "torch.nn.Module") -> int: ...
    def vae_factor(self) -> int: ...
    def decode(self, latents: "torch.Tensor") -> "torch.Tensor": ...


# --- environments ---------------------------------------------------------------------------------
@runtime_checkable
class Env(Protocol):
    """Tasks and their verifier. Factory context: ``seed``.

    ``tasks(split)``: the tasks of ``"train"`` or ``"eval"``; ``reward(sample)``: the verifier's
    score (a finite float; ``>= 1`` counts as correct in ``eval_accuracy``).
    """

    def tasks(self, split: str) -> Sequence[Task]: ...
    def reward(self, sample: Sample) -> float: ...


@runtime_checkable
class OffersTokenizer(Protocol):
    """An env that ships its own tokenizer (e.g. a character vocabulary): the model spec's default."""

    def tokenizer(self) -> Any: ...


@runtime_checkable
class Demonstrates(Protocol):
    """An env with reference answers for supervised training: ``demonstrations()`` yields
    ``(task, response_text)`` pairs, or ``(task, messages)`` for multi-turn ones, which the run's
    rollout component lays out (``RendersTranscripts``)."""

    def demonstrations(self) -> Sequence[tuple[Task, Any]]: ...


@runtime_checkable
class UsesTokenizer(Protocol):
    """An env whose tasks depend on the run's tokenizer (e.g. prompts dropped over a token length,
    a chat template checked): ``use_tokenizer(tokenizer)`` is called once, right after the model
    spec built the tokenizer and before any ``tasks(split)``."""

    def use_tokenizer(self, tokenizer: Any) -> None: ...


@runtime_checkable
class TrainsInEpochs(Protocol):
    """An env whose training tasks a run visits in epochs rather than sampling them at random each
    step (``miles.taskorder``): every epoch rolls out each task of ``tasks("train")`` once, steps take
    consecutive slices, and each step logs ``epoch``. ``shuffle_epochs``: each epoch in its own
    order, shuffled by ``run.seed`` and the epoch number; False: the order of ``tasks("train")``."""

    shuffle_epochs: bool


@runtime_checkable
class EnvMetrics(Protocol):
    """An env's own step metrics (e.g. its verifier's extraction failures): ``metrics(samples)``
    over a step's (or an evaluation's) samples, merged into the step's metrics like a rollout's."""

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]: ...


@runtime_checkable
class ExtractsAnswers(Protocol):
    """An env that can say which final answer a scored sample gave: ``answer(sample)``, text that
    is equal for equal answers (``0.5`` and ``\\frac12`` alike), or None when it found none.
    ``miles eval``'s majority voting (maj@k) counts these; without it, the stripped response."""

    def answer(self, sample: Sample) -> str | None: ...


@runtime_checkable
class ServiceEnv(Protocol):
    """An env whose episodes run in an outside service (an OpenEnv server, Harbor, a NeMo Gym agent,
    a verifiers worker) and are played by the rollout component of the same name: ``service``, that
    name (the rollout checks it before it reads the rest); ``cfg``: the env's validated settings,
    which say where the service is. What else the rollout reads (a client of the service, a list
    of failures) is between the two halves of that plugin."""

    service: str
    cfg: Any


# --- engines --------------------------------------------------------------------------------------
@runtime_checkable
class LoadsWeights(Protocol):
    """Takes weights in this process: ``load_weights(named_tensors, version)`` replaces them (HF
    names) and sets ``weight_version``; transports may hand tensors over by reference."""

    weight_version: int

    def load_weights(self, named_tensors: Named, version: int) -> None: ...


@runtime_checkable
class Engine(LoadsWeights, Protocol):
    """Rollout engine. Factory context: ``spec`` (ModelSpec), ``tokenizer``, ``seed``.

    ``generate(prompts, params, n)`` returns, for each prompt, ``n`` completions with per-token
    log-probs; ``load_weights`` as ``LoadsWeights`` (a client of servers in other processes raises
    there and is ``ReceivesWeights`` with ``remote``). An engine starts without usable weights: the
    loop syncs them first.
    """

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 n: int = 1) -> list[list[Completion]]: ...


@runtime_checkable
class ReportsChecksums(Protocol):
    """``weight_checksums(names)``: sha256 prefix per tensor the engine holds (``None``: no part of
    the engine holds the version just pushed); ``transport.verify`` compares them with the trainer's."""

    def weight_checksums(self, names: Sequence[str] | None = None) -> dict[str, str] | None: ...


@runtime_checkable
class ReceivesWeights(ReportsChecksums, Protocol):
    """An engine that takes weights over a wire (SGLang's weight-update API; ``miles serve`` and the
    sglang client implement it). ``remote``: the engine's memory is in another process (tensors
    cannot be handed over by reference). ``accepts_buckets``: ``update_weights_from_distributed``
    may carry one flat bucket per call.
    """

    remote: bool
    accepts_buckets: bool

    def update_weights_from_tensor(self, serialized_named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, weight_version: Any = None) -> Any: ...
    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str = ...,
                                        flush_cache: bool = True, weight_version: Any = None) -> Any: ...
    def update_weights_from_disk(self, model_path: str, weight_version: Any = None) -> Any: ...
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = ..., backend: str = ...) -> Any: ...
    def destroy_weights_update_group(self, group_name: str = ...) -> Any: ...


@runtime_checkable
class ServerGroup(Protocol):
    """A client of several engine servers. ``num_weight_ranks``: the ranks it takes in a
    weight-update group (one per server's tensor-parallel rank); ``restarts``: server restarts
    seen so far (a change means they left every group); ``servers_down()``: those not answering."""

    num_weight_ranks: int
    restarts: int

    def servers_down(self) -> list[str]: ...


@runtime_checkable
class ReceivesP2P(Protocol):
    """Engines that take point-to-point writes (``transport.name: p2p``): ``p2p_open(tensors,
    transport)`` registers a destination per tensor and returns each engine rank's endpoint
    (agent metadata, addresses, session); ``p2p_commit(weight_version, sessions)`` makes the
    written weights current once the trainer's writes are in."""

    def p2p_open(self, tensors: Sequence[dict], transport: str = "tcp") -> Any: ...
    def p2p_commit(self, weight_version: Any, sessions: Sequence[str]) -> Any: ...


@runtime_checkable
class Pausable(Protocol):
    """SGLang's ``pause_generation(mode="abort")`` / ``continue_generation()``: an async run with
    ``rollout.in_flight: resume`` aborts requests in flight around a weight push and the engine
    resumes them from their tokens so far (one ``Completion.weight_versions`` entry per segment)."""

    def pause_generation(self, mode: str = "abort") -> Any: ...
    def continue_generation(self) -> Any: ...


@runtime_checkable
class Interruptible(Protocol):
    """A generator a serving scheduler can stop mid-call: ``interrupt``, an event ``generate``
    checks between steps (set: it returns what it has); ``dropped``, indices of the call's prompts
    whose requests went away, which it stops decoding."""

    interrupt: threading.Event
    dropped: set[int]


@runtime_checkable
class ScoresBatches(Protocol):
    """``score(batch, logprob_fn) -> [B, R]``: the engine's log-probs of a training batch computed
    by ``logprob_fn(model, batch)`` on its own weights (``rollout.true_on_policy``)."""

    def score(self, batch: Batch, logprob_fn: Callable[..., "torch.Tensor"]) -> "torch.Tensor": ...


@runtime_checkable
class SamplesImages(Protocol):
    """A diffusion engine as the diffusion rollout drives it: ``encode(prompts)``: token ids per
    prompt; ``sample(prompt_ids, noise_seeds, stochastic, step_seed=, trajectory=)``: one image per
    row and its denoising trajectory (CPU tensors by name: ``images``, ``latents``, ``sigmas``,
    ``logprobs``, the conditioning, ``eta``, ``guidance``)."""

    weight_version: int

    def encode(self, prompts: Sequence[str]) -> list[list[int]]: ...
    def sample(self, prompt_ids: Sequence[Sequence[int]], noise_seeds: Sequence[int], stochastic: bool,
               step_seed: int = 0, trajectory: bool = True) -> dict[str, Any]: ...


# --- rollouts -------------------------------------------------------------------------------------
@runtime_checkable
class Rollout(Protocol):
    """Turns tasks into samples (``rollout.name``; the kernel's ``single_turn`` is the default).
    Factory context: ``out_dir`` (the run folder, e.g. for image grids); its settings sit in the
    ``rollout`` section beside the kernel's keys.

    ``generate(tasks, n, engine=, env=, tokenizer=, params=)``: per task, its ``n`` samples.
    Rewards may be left ``None`` (the env's verifier and ``miles_reward`` fill them). Optional
    ``metrics(samples) -> dict``: extra step metrics (e.g. ``turns_mean``), merged into the step's.
    """

    def generate(self, tasks: Sequence[Task], n: int, *, engine: Engine, env: Env, tokenizer: Any,
                 params: SamplingParams) -> list[list[Sample]]: ...


@runtime_checkable
class RolloutMetrics(Protocol):
    """A rollout's own step metrics (``Rollout``'s optional ``metrics``)."""

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]: ...


# --- trainers -------------------------------------------------------------------------------------
@runtime_checkable
class Trainer(Protocol):
    """Owns the policy (and reference) model and its optimizer. Factory context: ``spec``,
    ``tokenizer``, ``seed``, ``algorithm``, ``total_steps`` (the span of its LR schedule).

    ``logprobs(batch, which)``: no-grad log-probs ``[B, R]`` of the response tokens under ``which``
    in ``{"policy", "ref"}``; ``train_step(batch, loss_fn)``: one optimizer step over the batch
    (micro-batched), returns averaged metrics (``nonfinite_skipped`` when a NaN/inf loss or
    gradient made it skip the step); ``snapshot_reference()``: freeze the current policy as the
    reference model; ``load_weights(named)``: set the policy's weights (HF names);
    ``named_weights()``: full weights in HF names (an iterator, so a sharded trainer can stream
    them; on a ``Distributed`` trainer a collective every rank joins); ``save(dir)``/``load(dir)``:
    full training state.
    """

    def logprobs(self, batch: Batch, which: str = "policy") -> "torch.Tensor": ...
    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]: ...
    def snapshot_reference(self) -> None: ...
    def load_weights(self, named_tensors: Named) -> None: ...
    def named_weights(self) -> Iterator[tuple[str, "torch.Tensor"]]: ...
    def save(self, path: str) -> None: ...
    def load(self, path: str) -> None: ...


@runtime_checkable
class Distributed(Protocol):
    """A trainer of several ranks (SPMD: every rank runs the loop). ``broadcast_object(obj, src)``:
    rank ``src``'s ``obj`` on every rank; ``barrier()``: wait for every rank."""

    rank: int
    world_size: int

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def barrier(self) -> None: ...


@runtime_checkable
class SupportsCritic(Protocol):
    """For an algorithm with ``needs_critic``: ``values(batch)``: no-grad ``[B, R]`` critic values
    (``V_t``: the state before response token ``t``); ``train_critic(batch, value_loss_fn)``: one
    critic optimizer step on ``value_loss_fn(batch, values) -> (loss, metrics)``."""

    def values(self, batch: Batch) -> "torch.Tensor": ...
    def train_critic(self, batch: Batch, value_loss_fn: LossFn) -> dict[str, float]: ...


@runtime_checkable
class ExactScoring(Protocol):
    """``response_logprobs(model, batch)``: the exact routine ``train_step`` scores with;
    ``rollout.true_on_policy`` has a ``ScoresBatches`` engine apply it to the engine's weights."""

    def response_logprobs(self, model: "torch.nn.Module", batch: Batch) -> "torch.Tensor": ...


@runtime_checkable
class SendsPacked(Protocol):
    """A trainer whose forward computes with rounded weights (``trainer.precision`` fp8 / mxfp8,
    ``trainer.qat`` int4). ``packed_formats``: ``{weight name: format}`` of those weights (empty:
    none); ``packed_weights()``: ``named_weights()`` with each of them replaced by the
    low-precision tensors and scales the engines serve (``miles_lowp.linear.packed`` names them),
    a collective like ``named_weights``. The loop syncs these when ``packed_formats`` is not empty.
    ``served_weights(named)``: the given weights with those rounded as the engines serve them, in
    their own dtype (what ``miles export`` writes)."""

    packed_formats: dict[str, str]

    def packed_weights(self) -> Iterator[tuple[str, "torch.Tensor"]]: ...
    def served_weights(self, named: Iterable[tuple[str, "torch.Tensor"]]) -> Iterator[tuple[str, "torch.Tensor"]]: ...


@runtime_checkable
class TrainsInPrecision(Protocol):
    """Trainer settings with a low-precision format: ``precision`` (``bf16``, ``fp8``, ``mxfp8``),
    ``qat`` (``int4`` or None) and ``qat_scope`` (``all``, ``experts``). An engine checks its
    rollout weight format against them (``miles_lowp.pairs``: Miles' supported pairs)."""

    precision: str
    qat: str | None
    qat_scope: str


# --- transports -----------------------------------------------------------------------------------
@runtime_checkable
class WeightSource(Protocol):
    """What a transport reads: a trainer, or a view of one (only some weights, a snapshot). Only
    rank 0 (``OnRank``) talks to engines; the others take part in ``named_weights()``."""

    def named_weights(self) -> Iterator[tuple[str, "torch.Tensor"]]: ...


@runtime_checkable
class OnRank(Protocol):
    """A weight source that lives on one trainer rank (``rank``; a source without one is rank 0's)."""

    rank: int


@runtime_checkable
class Transport(Protocol):
    """Moves weights from the trainer to engines. Factory context: ``out_dir``.

    ``sync(source, engines, version)`` pushes ``source.named_weights()`` and returns metrics (at
    least ``weight_sync_seconds`` and ``weight_sync_bytes``); every trainer rank calls it.
    """

    def sync(self, source: WeightSource, engines: Sequence[Engine], version: int) -> dict[str, float]: ...


# --- algorithms -----------------------------------------------------------------------------------
@runtime_checkable
class Algorithm(Protocol):
    """Turns groups into a loss. Factory context: none.

    ``uses_rollout``: False for supervised algorithms (batches come from demonstrations);
    ``needs_reference``: the loop asks the trainer for ``ref_logprobs``; ``needs_critic``: the
    algorithm is a ``CriticAlgorithm``; the loop puts ``trainer.values(batch)`` in
    ``batch.extras["values"]`` and, after each policy step, trains the critic;
    ``keep(group)``: the algorithm's own filter (e.g. drop zero-variance groups);
    ``advantages(groups)``: per group, per sample a float or a per-action list;
    ``loss(batch, logprobs)``: this micro-batch's share of the loss (see ``Batch.token_mean``).
    """

    uses_rollout: bool
    needs_reference: bool
    needs_critic: bool

    def keep(self, group: Group) -> bool: ...
    def advantages(self, groups: Sequence[Group]) -> list[list[Any]]: ...
    def loss(self, batch: Batch, logprobs: "torch.Tensor") -> "tuple[torch.Tensor, dict[str, float]]": ...


@runtime_checkable
class CriticAlgorithm(Protocol):
    """An algorithm with a value model (``needs_critic``, e.g. PPO): ``critic_lr``, the critic
    optimizer's learning rate (None: the trainer's ``lr``), read when a trainer builds the critic;
    ``value_loss(batch, values) -> (loss, metrics)``, which the loop hands to the trainer's
    ``SupportsCritic.train_critic`` after each policy step."""

    critic_lr: float | None

    def value_loss(self, batch: Batch, values: "torch.Tensor") -> "tuple[torch.Tensor, dict[str, float]]": ...


@runtime_checkable
class Prepares(Protocol):
    """``prepare(batch) -> metrics``: once per step on the whole batch after its ref/old log-probs
    (and critic values) are filled, before any optimizer step (KL in the reward, GAE, whitening)."""

    def prepare(self, batch: Batch) -> dict[str, float]: ...


@runtime_checkable
class BuildsBatches(Protocol):
    """``make_batch(samples, pad_id, advantages) -> Batch``: the algorithm's own layout (SFT's
    packed rows; a non-token batch of trajectories) instead of ``Batch.from_samples``."""

    def make_batch(self, samples: list[Sample], pad_id: int, advantages: Any) -> Batch: ...


@runtime_checkable
class SuppliesSamples(Protocol):
    """What a supervised algorithm (``uses_rollout`` False) trains on: ``count`` samples of its own
    (e.g. a dataset file), or of the ``env``'s demonstrations (``Demonstrates``; multi-turn ones
    laid out by the ``rollout`` component, ``RendersTranscripts``); ``None``: it has none."""

    def supervised_samples(self, tokenizer: Any, count: int, rng: Any, version: int, *, env: Any = None,
                           rollout: Any = None) -> list[Sample] | None: ...


# --- run modes ------------------------------------------------------------------------------------
@runtime_checkable
class Rollouts(Protocol):
    """What a run mode uses to produce groups: rank 0's rollout service (``miles.rollouts``).
    ``run(tasks, n, params)``: groups with rewards set (custom ``miles_rollout`` hooks first, then
    the ``rollout.name`` component); ``keep(group)``: the algorithm's filter and every
    ``miles_filter``. The caller holds the mode's engine lock around ``run``."""

    def run(self, tasks: list[Task], n: int, params: SamplingParams) -> list[Group]: ...
    def keep(self, group: Group) -> bool: ...


@runtime_checkable
class Mode(Protocol):
    """How rollout and training interleave (``run.mode``). Factory context: ``ctx``, a
    ``miles.rollouts.ModeContext`` (what a mode uses, never the loop). Its own settings sit in the
    ``rollout`` section. Built on every trainer rank.

    ``take(rng, params)``: rank 0, once per RL step: the step's kept groups and its rollout metrics
    (at least ``reward_mean``, ``groups_kept``, ``groups_dropped``, ``rollout_seconds``); on
    ``EngineRestarted`` every rank pushes the weights again, then ``take`` is asked again.
    ``push(source, engines, version, wait)``: every rank: the weights to the engines as
    ``version`` through the transport; ``wait=False`` (the push after a training step) lets the
    mode finish it later. ``finish_push()`` waits for such a push and returns its metrics.
    ``reweight(batch, logprobs)``: every rank, in each loss call: the batch the loss sees and extra
    metrics (e.g. importance weights of stale samples). ``lock_engines()``: held around each use
    of the engines outside ``take``. ``close()``: at the end of the run, also after an error.
    """

    def take(self, rng: Any, params: SamplingParams) -> tuple[list[Group], dict[str, Any]]: ...
    def push(self, source: WeightSource, engines: Sequence[Engine], version: int,
             wait: bool = True) -> dict[str, float]: ...
    def finish_push(self) -> dict[str, float]: ...
    def reweight(self, batch: Batch, logprobs: "torch.Tensor") -> tuple[Batch, dict[str, float]]: ...
    def lock_engines(self) -> ContextManager[Any]: ...
    def close(self) -> None: ...


# --- launchers and loggers ------------------------------------------------------------------------
@runtime_checkable
class Launcher(Protocol):
    """Places and supervises the processes of a run. Factory context: none.

    ``launch(config, pm, plugins)`` runs the whole job and returns its exit code: it starts
    trainer ranks (``miles train`` with torchrun-style ``RANK``/``WORLD_SIZE``/``MASTER_*`` and
    ``MILES_LAUNCHED=1``, so they run the loop instead of launching again) and engine workers,
    turns a dead child into an error that names it, and leaves no process behind on success,
    failure or Ctrl-C. ``plugins``: launch-time plugin modules the children must load too.
    """

    def launch(self, config: Config, pm: MilesPluginManager, plugins: list[str]) -> int: ...


@runtime_checkable
class Logger(Protocol):
    """Metric sink. Factory context: ``out_dir``, ``total_steps``, ``config`` (the run's resolved
    config as a plain dict, for sinks that record it)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class Console(Protocol):
    """A logger that is the run's console (the ``console`` plugin's): ``message(text)``: a notice
    or warning line; ``progress(phase, done, total)``: ``done`` of ``total`` units of a long phase
    (warm start, evaluation) are finished, ``done == total`` ends it."""

    def message(self, text: str) -> None: ...
    def progress(self, phase: str, done: int, total: int) -> None: ...


# --- telemetry (what miles dashboard shows) ---------------------------------------------------------
@runtime_checkable
class Recorder(Protocol):
    """What a run records for ``miles dashboard``, on trainer rank 0 (``miles_telemetry.RunRecorder``
    is the kernel's; ``run.telemetry`` configures it). It must stay cheap: the loop calls it at span
    boundaries of every step.

    ``open(out_dir, tokenizer, engine_stats)``: start writing (``engine_stats()``: one reading per
    engine, see ``EngineStats``); ``span(name, **attrs)``: a context manager timing one span on
    the calling thread's lane (``rollout``, ``generate``, ``reward``, ``filter``, ``train``,
    ``weight_sync``, ``eval``), whose value is a dict of attributes the block may fill in (``generate``: ``tokens``);
    ``pick(step, samples, advantages)``: the step's training samples, of which it keeps a few;
    ``train_logprobs(samples, logprobs)``: a (micro-)batch's training log-probs ``[B, R]``, row
    ``i`` of ``samples[i]``; ``step_end(step, metrics)``: the step is logged, returns metrics the
    recorder adds to it; ``close()``: at the end of the run, also after an error.
    """

    def open(self, out_dir: str, tokenizer: Any = None,
             engine_stats: Callable[[], list[dict[str, Any]]] | None = None) -> None: ...
    def span(self, name: str, **attrs: Any) -> ContextManager[Any]: ...
    def pick(self, step: int, samples: Sequence[Sample], advantages: Sequence[Any]) -> None: ...
    def train_logprobs(self, samples: Sequence[Sample], logprobs: "torch.Tensor") -> None: ...
    def step_end(self, step: int, metrics: dict[str, Any]) -> dict[str, float]: ...
    def close(self) -> None: ...


@runtime_checkable
class EngineStats(Protocol):
    """An engine that reports its load: ``engine_stats()``, one dict per engine (server) with any
    of ``name``, ``running`` and ``queued`` requests, ``kv_cache_usage`` (0-1),
    ``generated_tokens`` (a running total), ``spec_accept_rate``; read every few seconds from
    another thread, so it must not wait on generation."""

    def engine_stats(self) -> list[dict[str, Any]]: ...


@runtime_checkable
class ExportsDraft(Protocol):
    """A trainer that may train a speculative-decoding draft beside the policy (the ``draft:``
    section): its ``named_weights`` carry the draft's too (weight syncs and checkpoints take them
    along); ``model_weights()`` are the policy's alone, and ``export_draft(folder)`` writes the
    draft beside a model exported there (nothing when it trains none)."""

    def model_weights(self) -> Iterator[tuple[str, "torch.Tensor"]]: ...
    def export_draft(self, folder: str) -> None: ...


@runtime_checkable
class EngineStepMetrics(Protocol):
    """An engine with metrics of its own about the rollouts it generated, e.g. speculative
    decoding's ``spec_accept_len`` and ``spec_accept_rate``: ``step_metrics()`` covers what it
    generated since its last call (empty: nothing to report) and is merged into the step's (or an
    evaluation's, prefixed ``eval_``) metrics."""

    def step_metrics(self) -> dict[str, float]: ...


# --- tools and multi-turn demonstrations ----------------------------------------------------------
@runtime_checkable
class OffersTools(Protocol):
    """An env whose tasks are solved with tools (multi-turn rollouts, ``rollout.name: multi_turn``).

    ``tools()``: tool specs in OpenAI's function format (``{"type": "function", "function":
    {"name", "description", "parameters"}}``), shown to chat-template models with the prompt;
    ``call_tool(name, arguments, task)``: run one call for ``task`` and return its output text;
    raise (any exception) for a bad call: the rollout shows the model ``error: <message>``.
    """

    def tools(self) -> Sequence[dict]: ...
    def call_tool(self, name: str, arguments: dict, task: Task) -> str: ...


@runtime_checkable
class RendersTranscripts(Protocol):
    """A rollout component that lays out a multi-turn demonstration as it lays out its own samples.
    A ``Demonstrates`` env may yield ``(task, messages)`` instead of ``(task, response_text)``:
    ``messages`` are ``{"role": "assistant" | "tool", "content": str}`` dicts; supervised phases
    (``sft``, the warm start) turn them into samples with ``demonstration(task, messages, tokenizer=, env=,
    version=)``: assistant turns trained on, tool results ``loss_mask`` 0."""

    def demonstration(self, task: Task, messages: Sequence[dict], *, tokenizer: Any, env: Any = None,
                      version: int = 0) -> Sample: ...


# --- mixture of experts ---------------------------------------------------------------------------
@runtime_checkable
class RoutingRecorder(Protocol):
    """Records one model's expert routing: ``recording()`` (a context manager: every forward inside
    is logged), ``take()`` (the log, one int32 ``[tokens, moe_layers, top_k]`` tensor per forward,
    tokens in the forward's row-major (row, position) order), ``extension`` (the
    ``Sample.extensions`` key its records travel under)."""

    extension: str

    def recording(self) -> ContextManager[Any]: ...
    def take(self) -> list["torch.Tensor"]: ...


@runtime_checkable
class RecordsGraphReplays(Protocol):
    """A ``RoutingRecorder`` that follows forwards replayed from a CUDA graph (no hook runs in a
    replay): ``mark()`` (the log's length now), ``split_off(mark)`` (removes and returns the entries
    logged since ``mark``: a capture's, whose tensors are the graph's own output buffers), and
    ``log_copies(entries)`` (logs a copy of them, after each replay overwrote them)."""

    def mark(self) -> int: ...
    def split_off(self, mark: int) -> list["torch.Tensor"]: ...
    def log_copies(self, entries: list["torch.Tensor"]) -> None: ...


@runtime_checkable
class RecordsRouting(Protocol):
    """A model spec whose mixture-of-experts models can record the experts each token is routed to
    (rollout routing replay, R3): ``routing_recorder(model)``, a ``RoutingRecorder``. An engine returns a
    completion's rows as ``Completion.extras[extension] = {"routed_experts": Tensor}``, shaped
    ``[prompt + response - 1, layers, top_k]`` (the last token is never fed back), and the spec's
    ``ScoresActions.action_logprobs`` replays them in the trainer."""

    def routing_recorder(self, model: "torch.nn.Module") -> RoutingRecorder: ...


# --- architectures --------------------------------------------------------------------------------
@runtime_checkable
class Architecture(Protocol):
    """A model family's specifics, registered under a Hugging Face ``model_type`` with
    ``miles_register_architectures`` (factory context: none), so that model specs, engines,
    trainers and routing replay learn them without naming the family.

    ``padded_batches``: rows of different lengths may share a forward, left-padded, without
    changing any row's result (False where a layer's state ignores the padding mask, e.g. token
    compression by absolute position: the engine then pads such prompts on the right only, or
    batches only prompts of equal length).
    ``check_config(config)``: problems of an inline ``model.config`` (``model_type`` plus sizes),
    each a string starting with the key it is about; empty when it can build a model.
    """

    padded_batches: bool

    def check_config(self, config: dict[str, Any]) -> list[str]: ...


@runtime_checkable
class RoutesExperts(Protocol):
    """An architecture whose mixture-of-experts routers routing replay (R3) can drive.

    ``routers(model)``: the router modules, one per MoE layer in forward order; each has ``top_k``
    and ``num_experts`` and its forward returns ``(logits, weights, indices)`` (indices
    ``[tokens, top_k]``). ``gate_weights(router, logits, indices)``: the ``[tokens, top_k]`` weights
    that router gives experts ``indices``, from the ``logits`` its forward returned (so gradients
    reach the router), by the same operations as its forward: for the experts it chose itself,
    the weights it returned, bit for bit.
    """

    def routers(self, model: "torch.nn.Module") -> list["torch.nn.Module"]: ...
    def gate_weights(self, router: "torch.nn.Module", logits: "torch.Tensor",
                     indices: "torch.Tensor") -> "torch.Tensor": ...


@runtime_checkable
class OffersEngineAttention(Protocol):
    """An architecture with an inference-only attention for the engine's own model instance:
    ``engine_attention(model)`` replaces the forward of each of ``model``'s attention modules in
    place (e.g. multi-latent attention decoding over its cached latent with the up-projections
    absorbed) and returns how many it replaced. Weight names and shapes stay as they are (weight
    sync, quantized engine weights and routing replay see the same modules); forwards without a
    cache give transformers' result bit for bit. Trainers never call it."""

    def engine_attention(self, model: "torch.nn.Module") -> int: ...


@runtime_checkable
class SlotCacheLayer(Protocol):
    """One layer's cache in the engine's rows (``OffersSlotLayers``): a transformers cache layer
    whose ``update`` writes each row's token at the decode step's position (``step.pos``) and
    returns the keys up to ``step.length``; ``window``: how many positions back a query sees (the
    engine's mask), None for all. A prefill runs prompts right-padded from position 0 through a
    transformers ``DynamicCache`` for the model, each of its layers first handed to ``watch(layer)``
    (to record what transformers does not keep); ``load(layer, rows, group, lengths)`` then copies
    them into ``rows`` (``group``: each row's prompt, of ``lengths[group]`` tokens);
    ``move(dst, src, length)`` copies rows; ``tensors()``: what it holds."""

    window: int | None

    def watch(self, layer: Any) -> None: ...
    def load(self, layer: Any, rows: "torch.Tensor", group: "torch.Tensor", lengths: "torch.Tensor") -> None: ...
    def move(self, dst: "torch.Tensor", src: "torch.Tensor", length: int) -> None: ...
    def tensors(self) -> list["torch.Tensor"]: ...


@runtime_checkable
class OffersSlotLayers(Protocol):
    """An architecture whose cache transformers cannot hold statically (DeepSeek-V4's compressed
    attention), holding it in the engine's cache rows itself, so the engine batches it
    continuously: ``slot_layers(model, step, slots, max_len)`` returns a ``SlotCacheLayer`` per
    layer of ``model`` (the engine's instance; it may switch modules' forwards to read them, as
    ``OffersEngineAttention`` does). A decode step's writes must be idempotent: a CUDA graph's
    warm-up runs it once before the capture."""

    def slot_layers(self, model: "torch.nn.Module", step: Any, slots: int, max_len: int) -> list: ...


@runtime_checkable
class KnowsArchitecture(Protocol):
    """A model spec that names its model's ``Architecture``: ``architecture()`` (None: no plugin
    registered one for its ``model_type``; everything then runs the generic way)."""

    def architecture(self) -> Architecture | None: ...


@runtime_checkable
class BuildsMegatron(Protocol):
    """An architecture the megatron trainer builds from megatron-core's modules:
    ``megatron_arch(hf_config)`` -> the trainer's architecture facts for this Hugging Face config
    (a dict of its ``Arch`` fields: multi-latent attention ranks, router score function, expert
    bias, expert groups, shared experts, dense layers, rotary fraction; miles-plugin-megatron's
    README lists them). Raises ``MilesError`` naming the config key it cannot build. An
    architecture that also ``EditsMegatronLayers`` inserts modules megatron-core lacks."""

    def megatron_arch(self, hf_config: Any) -> dict[str, Any]: ...


@runtime_checkable
class CarriesMTP(Protocol):
    """An architecture whose checkpoints carry multi-token-prediction layers that transformers
    drops when loading: ``attach_mtp(model, folder)`` adds the config's MTP layers to the
    transformers ``model`` under the checkpoint's own names (so trainer checkpoints, weight sync and
    export keep them), with their weights from the Hugging Face ``folder`` the model was loaded
    from (None: an inline config, initialised), and returns them, each with
    ``predict(hidden, next_ids, rotary) -> (hidden, logits)``: from the main model's last hidden
    states at position ``i`` and token ``i + 1``, the logits of token ``i + 2`` (``rotary``: the
    model's rotary embedding module), the step an ``mtp`` speculative-decoding draft runs."""

    def attach_mtp(self, model: "torch.nn.Module", folder: str | None) -> list["torch.nn.Module"]: ...


# --- the run, as phases, commands and launchers see it --------------------------------------------
@runtime_checkable
class RunContext(Protocol):
    """What a run offers the code that drives it from outside the loop: a phase before RL (the warm
    start, ``miles_warm_start``'s ``run``), ``miles eval`` / ``miles export`` and launchers (an
    initial model for their engines). ``miles.loop.Loop`` implements it.

    ``cfg``/``pm``: the run's config and plugin manager; ``main``: trainer rank 0; ``version``: the
    current weight version; ``components``: the run's env, spec, tokenizer, algorithm, engine,
    transport and trainer (after ``build``); ``rollout_component``: the ``rollout.name`` component.
    ``build(with_engine)``: make the components; ``new_trainer(found, settings=, algorithm=,
    total_steps=)``: a fresh trainer (holding checkpoint ``found``); ``update(samples, advantages,
    algorithm, minibatches=)``: optimizer step(s); ``publish()``: a new weight version, pushed;
    ``sync()``: push the current one; ``evaluate()``: the eval metrics; ``stopping()``: whether a
    signal asked the run to stop; ``console(text, progress=)``: a line or a phase's progress;
    ``export(path, why)``: a Hugging Face folder of the trainer's weights (no trainer: fresh ones).
    """

    cfg: Config
    pm: MilesPluginManager
    main: bool
    version: int
    components: Any
    rollout_component: Any

    def build(self, with_engine: bool = True) -> Any: ...
    def new_trainer(self, found: Any = None, settings: Any = None, algorithm: Any = None,
                    total_steps: int | None = None) -> Trainer: ...
    def update(self, samples: list[Sample], advantages: list, algorithm: Any, temperature: float = 1.0,
               minibatches: int | None = None) -> dict[str, float]: ...
    def publish(self, wait: bool = True) -> dict[str, float]: ...
    def sync(self, wait: bool = True) -> dict[str, float]: ...
    def evaluate(self) -> dict[str, float]: ...
    def stopping(self) -> bool: ...
    def console(self, text: str, progress: tuple[str, int, int] | None = None) -> None: ...
    def export(self, path: str, why: str = "") -> None: ...


# --- the register callables the registration hooks receive ----------------------------------------
class RegisterComponent(Protocol):
    """``register(name, factory, config=None)`` of ``miles_register_<kind>``: ``factory(settings,
    **context)`` makes the component (context as its kind's protocol lists); ``config``: the pydantic
    schema of its settings (None: it takes none). Names use ``-``; ``_`` spellings resolve too."""

    def __call__(self, name: str, factory: Callable[..., Any], config: Any = None) -> None: ...


class RegisterCommand(Protocol):
    """``register(name, help, add_arguments, run)`` of ``miles_register_commands``: ``miles <name>``;
    ``add_arguments(parser)`` adds its arguments to an ``argparse`` parser; ``run(args) -> int``."""

    def __call__(self, name: str, help: str, add_arguments: Callable[[Any], None],
                 run: Callable[[Any], int]) -> None: ...
