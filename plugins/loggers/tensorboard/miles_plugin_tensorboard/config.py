"""Settings of the ``tensorboard`` logger (an entry of the ``loggers:`` list)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TensorBoardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    log_dir: str | None = Field(None, description="event-file folder (default: <run.out_dir>/tensorboard)")
    flush_secs: float = Field(30.0, gt=0, description="seconds between flushes to disk (close() always flushes)")
