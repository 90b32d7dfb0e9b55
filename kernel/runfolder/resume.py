"""What a rerun in an existing run folder may change: checked before anything is built or written.

A checkpoint means the settings it was trained under. Changing what its weights or its tasks are
(the model, the env, the algorithm or trainer kind) would resume into something else, with weights
silently dropped or a mixed metric history, so it is refused with the list of changes. Steps,
logging and evaluation cadence are safe; any other change (a learning rate, a temperature) is
allowed and listed, so the user sees what differs from the run's config.yaml.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import MilesError

# changes that keep the checkpoint's meaning and need no word
SAFE = ("run.steps", "run.out_dir", "run.eval_every", "run.checkpoint_every", "run.keep_checkpoints",
        "run.threads", "run.max_nonfinite_steps", "run.telemetry", "run.warm_start", "loggers", "plugins")
# changes that make the checkpoint mean something else
MEANING = ("model", "env", "algorithm.name", "trainer.name")
ALIASES = {"sync": "transport"}  # older section spellings in a run folder's config.yaml


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            key = ALIASES.get(str(key), str(key)) if not prefix else str(key)
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    value = data.replace("_", "-") if prefix.endswith(".name.") and isinstance(data, str) else data
    return {prefix[:-1]: value}


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def checkpoint_steps(out_dir: str) -> list[int]:
    """Steps of the sealed checkpoints in ``out_dir`` (intact or not), oldest first."""
    steps = []
    for d in (Path(out_dir) / "checkpoints").glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", d.name)
        if m and (d / "state.json").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def check_resume(out_dir: str, resolved: dict[str, Any], steps: int) -> tuple[str | None, bool]:
    """Refuse a rerun whose config changes what the run folder's checkpoint means, or whose
    ``run.steps`` is below the steps already trained. Returns a note for the console (the allowed
    changes, or that the run is already finished) or None, and whether every step is trained."""
    done = checkpoint_steps(out_dir)
    if not done:
        return None, False  # nothing trained yet: a fresh start, whatever the config says
    old = _old_config(Path(out_dir) / "config.yaml")
    changed = []
    if old is not None:
        before, after = _flat(old), _flat(resolved)
        changed = [(k, before[k], after[k]) for k in sorted(before.keys() & after.keys())
                   if before[k] != after[k] and not _under(k, SAFE)]
        changed += [(k, before[k], "(removed)") for k in sorted(before.keys() - after.keys())
                    if _under(k, MEANING)]
        # a key the old file lacks may be a default a later miles added: only a new component name counts
        changed += [(k, "(absent)", after[k]) for k in sorted(after.keys() - before.keys())
                    if _under(k, MEANING) and k.endswith(".name")]
    # a step-0 checkpoint holds the initial (possibly warm-started) policy that no RL algorithm has
    # trained yet: starting RL from it with another algorithm changes nothing it means
    meaning = tuple(k for k in MEANING if not (done[-1] == 0 and k == "algorithm.name"))
    refused = [c for c in changed if _under(c[0], meaning)]
    if refused:
        lines = "\n".join(f"  - {k}: {a!r:.80} -> {b!r:.80}" for k, a, b in refused)
        raise MilesError(f"{out_dir} holds a checkpoint at step {done[-1]} trained under other settings; "
                         f"resuming would change what it means:\n{lines}\nrestore these settings to resume, "
                         f"or pick a new run.out_dir to start a new run")
    if steps < done[-1]:
        raise MilesError(f"run.steps={steps}, but {out_dir} has already trained {done[-1]} steps (checkpoint "
                         f"step_{done[-1]:06d}); raise run.steps to train further, evaluate it with miles eval, "
                         f"or pick a new run.out_dir to start over")
    if steps == done[-1] and _damaged(out_dir, done[-1]):
        done = done[:-1] or [0]  # the restore reports it and resumes from an older one: not finished
    notes = []
    if changed:
        notes.append("resuming with changed settings: " + ", ".join(f"{k} {a!r:.40} -> {b!r:.40}"
                                                                   for k, a, b in changed))
    if steps == done[-1]:
        notes.append(f"{out_dir} has already trained all {steps} steps; nothing to do (raise run.steps to "
                     f"train further)")
    return "\n".join(notes) or None, steps == done[-1]


def _damaged(out_dir: str, step: int) -> bool:
    from .checkpoint import damage

    return damage(Path(out_dir) / "checkpoints" / f"step_{step:06d}") is not None


def _old_config(path: Path) -> dict[str, Any] | None:
    """The run folder's resolved config, or None when it is missing or unreadable (an older run
    folder, or one whose config.yaml was lost: the checkpoint load then checks what it can)."""
    from ..configfile import load_text

    try:
        data = load_text(path.read_text())
    except Exception:  # noqa: BLE001 (unreadable for any reason: nothing to compare with)
        return None
    return data if isinstance(data, dict) else None
