"""Config of the ``torch`` engine. Kept free of torch imports so registration stays cheap."""
from typing import Literal

import pydantic
from pydantic import Field


class TorchEngineConfig(pydantic.BaseModel, extra="forbid"):
    device: str = Field("cpu", description='"cpu", "cuda", "cuda:N", or "auto" (cuda when available)')
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the engine's model weights and KV cache")
    max_batch_size: int = Field(
        1024, ge=1, description="max sequences decoded in one forward; larger requests are chunked")
