"""Settings of the ``moe`` model spec (pydantic only: importable without torch)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


def resolve_base(base: dict[str, Any], pm: Any) -> tuple[str, Any]:
    """(name, validated settings) of the wrapped model spec, from the run's registry (a plugin
    never imports another's internals); a ``miles.ConfigError`` names ``model.base.<key>``."""
    from miles.config import validate_nested

    return validate_nested(pm, "model_specs", "model.base", base, "hf", wrapper="moe")


class MoESpecConfig(BaseModel):
    """A mixture-of-experts model (Qwen3-MoE, Mixtral) built by another spec (``base``)."""

    model_config = ConfigDict(extra="forbid")

    base: dict[str, Any] = Field(..., description=(
        "the wrapped model spec's section: its name (default hf) and its own settings, e.g. "
        "{name: hf, config: {model_type: qwen3_moe, num_experts: 8, num_experts_per_tok: 2, ...}}"))
    routing_replay: bool = Field(True, description=(
        "rollout routing replay (R3): the engine records the experts every token was routed to "
        "(prompt and response) and the trainer's forward uses exactly those experts, with gate "
        "weights recomputed from its own router logits so the router still learns"))
