"""The trainer settings of INT4 quantization-aware training, one schema for every trainer (they
must agree with the engine's ``weights_dtype`` and ``quant_scope`` the same way); torch-free."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class QATSettings(BaseModel):
    """``qat`` and ``qat_scope``, the fields a trainer's config takes by subclassing this."""

    qat: Literal["int4"] | None = Field(
        None, description="int4: quantization-aware training for INT4 rollout (engine.weights_dtype: int4): "
        "the forward's weights of the linear layers (not the output head) are rounded to symmetric INT4 "
        "with a scale per 128 (straight-through gradient) and the engines get them packed")
    qat_scope: Literal["all", "experts"] = Field(
        "all", description="with qat: all linear layers but the output head and the MoE expert weights, "
        "or only the experts (must match engine.quant_scope)")
