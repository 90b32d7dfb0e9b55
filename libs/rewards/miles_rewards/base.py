"""The library's API: ``make_reward(name, settings)`` returns a ``Reward``, a callable
``reward(response, label, metadata, prompt=...) -> RewardResult(score, metrics)``."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, runtime_checkable

from pydantic import BaseModel, ValidationError

from .settings import SETTINGS

REWARDS: tuple[str, ...] = tuple(SETTINGS)
# name -> "module:class", imported when a reward is made (math-verify, openai load only if used)
_IMPL = {"math": "mathverify:MathReward", "exact": "text:ExactReward", "choice": "text:ChoiceReward",
         "regex": "text:RegexReward", "code": "code:CodeReward", "judge": "judge:JudgeReward"}
# settings a reward cannot run without (None by default so an env's schema can validate them lazily)
_REQUIRED = {"regex": ("pattern",), "judge": ("base_url",)}


class RewardConfigError(ValueError):
    """Bad reward name or settings; the message names the key and what is allowed."""


@dataclass(frozen=True)
class RewardResult:
    """``score``: the reward (a finite float; 1.0 is fully correct). ``metrics``: this call's own
    figures, the same keys on every call of a reward (e.g. ``math_extract_failed`` 0.0 or 1.0),
    which ``mean_metrics`` averages over a step's samples. ``answer``: the final answer the reward
    read, canonical so equal answers compare equal (majority voting), or None when none was found."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)
    answer: str | None = None


@runtime_checkable
class Reward(Protocol):
    """A built-in reward. ``label``: the row's answer (any JSON value); ``metadata``: the row's
    other columns (e.g. ``tests`` for ``code``); ``prompt``: the task's prompt, text or chat
    messages (the judge shows it). Never raises for a bad response: that is a low score."""

    name: str
    metric_names: tuple[str, ...]

    def __call__(self, response: str, label: Any = None, metadata: Mapping[str, Any] | None = None, *,
                 prompt: Any = None) -> RewardResult: ...


def validate_settings(name: str, settings: Mapping[str, Any] | BaseModel | None = None) -> BaseModel:
    """``settings`` checked against reward ``name``'s schema (``miles_rewards.settings``); a
    ``RewardConfigError`` lists every problem as ``key: what is wrong``."""
    if name not in SETTINGS:
        raise RewardConfigError(f"unknown reward {name!r}; built-in rewards: {', '.join(REWARDS)}")
    schema = SETTINGS[name]
    if isinstance(settings, schema):
        parsed = settings
    else:
        try:
            parsed = schema.model_validate(dict(settings or {}))
        except ValidationError as e:
            problems = []
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"])
                hint = f" (allowed: {', '.join(schema.model_fields)})" if err["type"] == "extra_forbidden" else ""
                problems.append(f"{loc}: {err['msg']}{hint}")
            raise RewardConfigError(f"reward {name!r}: " + "; ".join(problems)) from None
    missing = [k for k in _REQUIRED.get(name, ()) if getattr(parsed, k) is None]
    if missing:
        raise RewardConfigError(f"reward {name!r} needs {', '.join(missing)} "
                                f"({'; '.join(schema.model_fields[k].description or '' for k in missing)})")
    return parsed


def make_reward(name: str, settings: Mapping[str, Any] | BaseModel | None = None) -> Reward:
    """The built-in reward ``name`` (one of ``REWARDS``) with ``settings`` (a dict or its schema's model)."""
    parsed = validate_settings(name, settings)
    module, cls = _IMPL[name].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)(parsed)


def mean_metrics(results: Iterable[RewardResult]) -> dict[str, float]:
    """Each metric's mean over ``results`` (a key a result lacks counts for that result as absent)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for r in results:
        for k, v in r.metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
            counts[k] = counts.get(k, 0) + 1
    return {k: sums[k] / counts[k] for k in sums}
