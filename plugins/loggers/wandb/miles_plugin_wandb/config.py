"""Settings of the ``wandb`` logger (an entry of the ``loggers:`` list)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class WandbConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline writes a local run folder with no network (wandb sync uploads it); "
                                "online needs WANDB_API_KEY or `wandb login`")
    project: str = Field("miles", min_length=1, description="W&B project")
    run_name: str | None = Field(None, description="W&B run name (default: the run folder's name; "
                                                   "`name` selects the logger)")
    entity: str | None = Field(None, description="W&B team or user (online mode)")
    dir: str | None = Field(None, description="where wandb writes its 'wandb/' folder (default: run.out_dir)")
    tags: list[str] = Field(default_factory=list, description="run tags")
