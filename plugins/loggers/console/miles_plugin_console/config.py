"""Settings of the ``console`` logger (a ``loggers:`` entry ``{name: console, every: N}``)."""
from pydantic import BaseModel, ConfigDict, Field


class ConsoleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    every: int = Field(1, gt=0, description="print every N steps (evaluations always print)")
