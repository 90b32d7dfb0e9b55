"""Settings of the ``mlflow`` logger (an entry of the ``loggers:`` list)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MlflowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tracking_uri: str | None = Field(
        None, description="MLflow tracking store: sqlite:///path.db, http(s)://server, databricks "
                          "(default: sqlite:///<run.out_dir>/mlflow.db)")
    experiment: str = Field("miles", min_length=1, description="experiment name (created when missing)")
    run_name: str | None = Field(None, description="run name (default: the run folder's name)")
