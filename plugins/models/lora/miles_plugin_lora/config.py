"""Settings of the ``lora`` model spec (pydantic only: importable without torch or peft)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# how recipes/lora.yaml's base is made; named in the error for a missing folder
MAKE_BASE = ("miles train recipes/quickstart.yaml run.steps=0 run.out_dir=runs/warm-start && "
             "miles export runs/warm-start --to runs/warm-start/export")


def resolve_base(base: dict[str, Any], pm: Any) -> tuple[str, Any]:
    """(name, validated settings) of the wrapped model spec, from the run's registry (a plugin
    never imports another's internals); a ``miles.ConfigError`` names ``model.base.<key>``."""
    from miles.config import validate_nested

    return validate_nested(pm, "model_specs", "model.base", base, "hf", wrapper="lora")


class LoraSpecConfig(BaseModel):
    """LoRA (low-rank adapters, Hu et al. 2021) on the model of another spec (``base``)."""

    model_config = ConfigDict(extra="forbid")

    base: dict[str, Any] = Field(..., description=(
        "the wrapped model spec's section: its name (default hf) and its own settings, e.g. "
        "{name: hf, path: runs/sft/export} or {name: hf, config: {model_type: qwen2, ...}}"))
    r: int = Field(8, gt=0, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is B @ A * alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training "
                           "(engines run in eval mode, without it)")
    target_modules: list[str] | str = Field("all-linear", description=(
        "module names (or name suffixes) that get adapters, e.g. [q_proj, v_proj]; 'all-linear' "
        "adapts every linear layer except the output head"))

    @field_validator("base")
    @classmethod
    def _base_is_a_model_spec(cls, v: dict[str, Any]) -> dict[str, Any]:
        path = v.get("path")
        if isinstance(path, str) and not Path(path).is_dir():
            raise ValueError(f"model.base.path: base model folder {path} does not exist; train and export "
                             f"a full-parameter model first, e.g. `{MAKE_BASE}`")
        return v  # the spec's name and settings: miles_validate_config, with the run's plugins
