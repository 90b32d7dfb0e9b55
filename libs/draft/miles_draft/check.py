"""Checks of the ``draft:`` section against the rest of the run's config, shared by the trainer
plugins that train a draft: each calls ``problems`` with its own name from its
``miles_validate_config``, and exactly one of them reports (the run's trainer, or the first of
``TRAINERS`` when the run's trainer trains no draft)."""
from __future__ import annotations

import os
from typing import Any, Callable

TRAINERS = ("fsdp2", "megatron")  # trainers that train a draft online


def speculative(config: Any) -> dict:
    """The ``engine.speculative`` mapping (empty when absent or malformed)."""
    engine = config.raw.get("engine") if isinstance(config.raw.get("engine"), dict) else {}
    spec = engine.get("speculative")
    return spec if isinstance(spec, dict) else {}


MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")  # DeepSeek/GLM, Qwen3-Next/3.5


def model_configs(config: Any) -> list[dict]:
    """The Hugging Face configs the run's model section declares: its inline ``model.config``
    (also under ``model.base``, as the moe spec wraps one) or the ``config.json`` of its local
    ``model.path`` folder."""
    import json
    from pathlib import Path

    model = config.raw.get("model") if isinstance(config.raw.get("model"), dict) else {}
    out = []
    for m in (model, model.get("base") if isinstance(model.get("base"), dict) else {}):
        hf = m.get("config")
        if not isinstance(hf, dict) and isinstance(m.get("path"), str):
            try:
                hf = json.loads((Path(m["path"]) / "config.json").read_text())
            except (OSError, ValueError):
                hf = None
        if isinstance(hf, dict):
            out.append(hf)
    return out


def declares_mtp(config: Any) -> bool:
    """Whether the run's model declares multi-token-prediction layers (``model_configs``)."""
    return any(isinstance(hf.get(k), int) and hf[k] > 0 for hf in model_configs(config) for k in MTP_KEYS)


def vocab_problem(config: Any, raw: dict) -> str | None:
    """``draft.vocab`` above the model's vocabulary, where the config declares it (otherwise the
    head refuses it when it is made)."""
    n = raw.get("vocab")
    sizes = [hf["vocab_size"] for hf in model_configs(config) if isinstance(hf.get("vocab_size"), int)]
    from .config import vocab_too_big

    if isinstance(n, int) and not isinstance(n, bool) and sizes:
        return vocab_too_big(n, sizes[0])
    return None


def problems(config: Any, raw: Any, me: str, validate: Callable[[Any, str, dict, list[str]], Any]) -> list[str]:
    """What is wrong with the ``draft:`` section ``raw``, if the trainer plugin ``me`` is the one
    to tell (else nothing, so that no problem is reported twice). ``validate``: the kernel's
    settings validator (``miles.config.validate_settings``), passed in by the plugin so that this
    library uses only the kernel's public names."""
    from .config import DraftConfig

    trainer = config.name("trainer")
    if me != (trainer if trainer in TRAINERS else TRAINERS[0]):
        return []
    out: list[str] = []
    if not isinstance(raw, dict):
        return [f"draft: must be a mapping of keys to values (got {raw!r})"]
    validate(DraftConfig, "draft", raw, out)
    too_big = vocab_problem(config, raw)
    if too_big:
        out.append(too_big)
    if trainer not in TRAINERS:
        out.append(f"draft: the draft is trained by trainer {' or '.join(TRAINERS)} (trainer.name is "
                   f"{trainer!r}); remove the draft: section or use one of those trainers")
    drafts = speculative(config).get("draft")
    # a model's MTP layers may train without the engine drafting (e.g. where the engine's forward is
    # not the fast path's or drafting is off): they are the model's own weights, synced and exported with it
    mtp_only = not drafts and declares_mtp(config)
    # a trainer rank that a launcher started drives the launcher's `miles serve` workers through the
    # sglang client; the launcher checked the run's own engine section (torch, drafting) already
    launched = bool(os.environ.get("MILES_LAUNCHED")) and config.name("engine") == "sglang"
    if not mtp_only and not launched and (config.name("engine") != "torch" or drafts not in ("head", "mtp")):
        out.append("draft: trains a draft head (or a model's MTP layers) that weight syncs send to the engine, "
                   "which needs to draft with it: set engine.speculative: {draft: head} (or {draft: mtp} for a "
                   "model with MTP layers; engine.name: torch); a model whose config declares MTP layers may "
                   "train them without it")
    return out
