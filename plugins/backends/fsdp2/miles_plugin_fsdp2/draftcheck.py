"""Checks of the ``draft:`` section against the rest of the run's config."""
from __future__ import annotations

from typing import Any


def problems(config: Any, raw: Any) -> list[str]:
    from miles.config import validate_settings
    from miles_draft.config import DraftConfig

    out: list[str] = []
    if not isinstance(raw, dict):
        return [f"draft: must be a mapping of keys to values (got {raw!r})"]
    validate_settings(DraftConfig, "draft", raw, out)
    if config.name("trainer") != "fsdp2":
        out.append(f"draft: the draft head is trained by trainer fsdp2 (trainer.name is "
                   f"{config.name('trainer')!r}); remove the draft: section or use trainer.name: fsdp2")
    engine = config.raw.get("engine") if isinstance(config.raw.get("engine"), dict) else {}
    spec = engine.get("speculative") if isinstance(engine.get("speculative"), dict) else {}
    if config.name("engine") != "torch" or spec.get("draft") not in ("head", "mtp"):
        out.append("draft: trains a draft head (or a model's MTP layers) that weight syncs send to the engine, "
                   "which needs to draft with it: set engine.speculative: {draft: head} (or {draft: mtp} for a "
                   "model with MTP layers; engine.name: torch)")
    return out
