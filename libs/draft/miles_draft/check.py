"""Checks of the ``draft:`` section against the rest of the run's config, shared by the trainer
plugins that train a draft: each calls ``problems`` with its own name from its
``miles_validate_config``, and exactly one of them reports (the run's trainer, or the first of
``TRAINERS`` when the run's trainer trains no draft)."""
from __future__ import annotations

from typing import Any

TRAINERS = ("fsdp2", "megatron")  # trainers that train a draft online


def speculative(config: Any) -> dict:
    """The ``engine.speculative`` mapping (empty when absent or malformed)."""
    engine = config.raw.get("engine") if isinstance(config.raw.get("engine"), dict) else {}
    spec = engine.get("speculative")
    return spec if isinstance(spec, dict) else {}


def problems(config: Any, raw: Any, me: str) -> list[str]:
    """What is wrong with the ``draft:`` section ``raw``, if the trainer plugin ``me`` is the one
    to tell (else nothing, so that no problem is reported twice)."""
    from miles.config import validate_settings

    from .config import DraftConfig

    trainer = config.name("trainer")
    if me != (trainer if trainer in TRAINERS else TRAINERS[0]):
        return []
    out: list[str] = []
    if not isinstance(raw, dict):
        return [f"draft: must be a mapping of keys to values (got {raw!r})"]
    validate_settings(DraftConfig, "draft", raw, out)
    if trainer not in TRAINERS:
        out.append(f"draft: the draft is trained by trainer {' or '.join(TRAINERS)} (trainer.name is "
                   f"{trainer!r}); remove the draft: section or use one of those trainers")
    if config.name("engine") != "torch" or speculative(config).get("draft") not in ("head", "mtp"):
        out.append("draft: trains a draft head (or a model's MTP layers) that weight syncs send to the engine, "
                   "which needs to draft with it: set engine.speculative: {draft: head} (or {draft: mtp} for a "
                   "model with MTP layers; engine.name: torch)")
    return out
