"""Data contracts shared by the kernel and every plugin: plain dataclasses, no torch at import time
(``Batch`` holds torch tensors; ``Batch.from_samples`` imports torch when called)."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

_task_ids = itertools.count()


@dataclass
class Task:
    """One prompt of an environment.

    ``prompt``: text (or a list of chat messages); ``label``: what the verifier compares against
    (e.g. the exact answer); ``metadata``: anything the env needs to score or continue it;
    ``id``: stable identifier (used for grouping and de-duplication).
    """

    prompt: Any
    label: Any = None
    metadata: dict = field(default_factory=dict)
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"task-{next(_task_ids)}"


class Status(str, enum.Enum):
    COMPLETED = "completed"  # hit a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # cancelled (engine paused, worker died)
    FAILED = "failed"  # custom rollout raised


@dataclass
class Sample:
    """One generated response to a task: a sequence of *actions* with their log-probs.

    The actions of a text sample are its response tokens: ``prompt_ids``/``response_ids`` are token
    ids, ``logprobs`` the engine's log-probability of each response token (temperature applied,
    before top-p/top-k), ``len == len(response_ids)``; ``loss_mask`` is 1 for tokens the policy
    produced (train on), 0 for tokens it did not. A multi-turn sample is still ONE token sequence:
    ``response_ids`` is everything after the prompt, model tokens keep the engine's own ids and
    log-probs (never re-tokenized), env/tool tokens have ``loss_mask`` 0 and logprob 0.0.
    A non-text sample (e.g. an image from a diffusion model) keeps its trajectory in
    ``extensions[plugin_id]`` (e.g. per-step latents ``[T+1, C, H, W]``, sigmas ``[T+1]``),
    ``response_ids`` empty and ``logprobs``/``loss_mask`` with one entry per step ``T``: the
    plugin's algorithm (``make_batch``) and model spec (``action_logprobs``) agree on the payload;
    the kernel never looks inside. ``weight_version``: version of the weights that generated it
    (the oldest, when several did); ``weight_versions``: the version of each generation segment, in
    order: two or more when the request was aborted at a weight update and resumed on the new
    weights (``rollout.in_flight: resume``), empty when unknown (then ``[weight_version]``);
    ``extensions``: plugin-specific data keyed by plugin id.
    """

    task: Task
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response: str = ""
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] | None = None
    reward: float | None = None
    status: Status = Status.COMPLETED
    weight_version: int = 0
    extensions: dict = field(default_factory=dict)
    weight_versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)


@dataclass
class Group:
    """The ``n`` samples drawn for one task (the unit of GRPO normalisation and of filtering)."""

    task: Task
    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [float(s.reward or 0.0) for s in self.samples]


@dataclass
class SamplingParams:
    """Per-request generation settings (names follow SGLang's ``sampling_params``): ``temperature == 0``
    means greedy; ``top_k <= 0`` and ``top_p >= 1`` disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Completion:
    """What an engine returns for one sampled sequence. ``weight_versions``: one per generation
    segment when a request was aborted and resumed (``weight_version`` is then the oldest).
    ``extras``: plugin data for the sample's ``extensions``, keyed the same way (e.g. an MoE
    model's routed experts, ``miles.protocols.RecordsRouting``); rollouts copy it over."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int = 0
    weight_versions: list[int] = field(default_factory=list)
    extras: dict = field(default_factory=dict)


@dataclass
class Batch:
    """A padded training batch of B samples: prompt region of width P (left-padded) followed by a
    response region of width R (right-padded), so every sample's response is ``[:, P:]``.
    R counts actions: response tokens, or a non-token batch's trajectory steps (built by an
    algorithm's ``make_batch``; its token fields are None and the model-specific tensors, e.g.
    latents, sit in ``extras``, each with B as its first dimension so ``select`` can slice it).

    Tensors: ``input_ids``, ``attention_mask``, ``position_ids`` ``[B, P+R]`` (long, or None);
    ``loss_mask``, ``advantages``, ``rollout_logprobs`` ``[B, R]`` (float);
    ``old_logprobs``/``ref_logprobs``/``teacher_logprobs`` ``[B, R]`` or None; ``rewards`` ``[B]``.
    ``global_tokens``/``global_samples``: loss-mask tokens and samples of the whole optimizer-step
    batch this (micro-)batch belongs to, so each micro-batch's loss is its share of the global
    mean (``token_mean``/``seq_mean``) and summing micro-batch gradients is exact.
    """

    input_ids: "torch.Tensor | None"
    attention_mask: "torch.Tensor | None"
    position_ids: "torch.Tensor | None"
    prompt_len: int
    loss_mask: "torch.Tensor"
    advantages: "torch.Tensor"
    rollout_logprobs: "torch.Tensor"
    rewards: "torch.Tensor"
    samples: list[Sample]
    old_logprobs: "torch.Tensor | None" = None
    ref_logprobs: "torch.Tensor | None" = None
    teacher_logprobs: "torch.Tensor | None" = None
    temperature: float = 1.0  # rollout temperature: the trainer divides logits by it
    global_tokens: float = 0.0
    global_samples: int = 0
    extras: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.loss_mask.shape[0]

    @classmethod
    def from_samples(cls, samples: list[Sample], pad_id: int, advantages: Any = None) -> "Batch":
        """Pad token samples into tensors (the ``miles_tokens`` library's layout). ``advantages``:
        per sample a float (broadcast over its response tokens) or a list of per-token floats; default 0."""
        from miles_tokens import pad_samples

        return cls(samples=list(samples), **pad_samples(samples, pad_id, advantages))

    def select(self, idx: list[int]) -> "Batch":
        """Rows ``idx`` as a new Batch that keeps this batch's global denominators."""
        import torch

        t = torch.tensor(idx, dtype=torch.long)
        rows = {f.name: getattr(self, f.name)[t] for f in fields(self) if hasattr(getattr(self, f.name), "shape")}
        return replace(self, **rows, samples=[self.samples[i] for i in idx],
                       extras={k: v[t] if hasattr(v, "shape") else v for k, v in self.extras.items()})

    def to(self, device: Any) -> "Batch":
        """This batch with every tensor (its fields and those in ``extras``) on ``device``."""
        import torch

        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        extras = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.extras.items()}
        return replace(self, **moved, extras=extras)

    def split(self, size: int) -> list["Batch"]:
        """Micro-batches of at most ``size`` rows (global denominators preserved)."""
        n = len(self)
        return [self.select(list(range(i, min(i + size, n)))) for i in range(0, n, size)]

    def as_global(self) -> "Batch":
        """This batch with its own totals as the global denominators (a new optimizer step)."""
        return replace(self, global_tokens=float(self.loss_mask.sum().clamp(min=1)),
                       global_samples=len(self))

    def token_mean(self, x: "torch.Tensor") -> "torch.Tensor":
        """This micro-batch's share of the global token-mean of ``x`` ``[B, R]`` over loss_mask."""
        return (x * self.loss_mask).sum() / self.global_tokens

    def seq_mean(self, x: "torch.Tensor") -> "torch.Tensor":
        """Share of the global mean over samples of each sample's token-mean of ``x``."""
        per_seq = (x * self.loss_mask).sum(-1) / self.loss_mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(self.global_samples, 1)
