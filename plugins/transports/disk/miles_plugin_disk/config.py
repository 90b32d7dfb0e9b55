"""Config of the ``disk`` transport. Kept free of torch imports so registration stays cheap."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DiskSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dir: str | None = Field(None, description="folder the weight versions are written to; default "
                                              "<run.out_dir>/weights, or a fresh folder under the "
                                              "system temp dir when no out_dir is known")
    shard_mb: int = Field(512, ge=1, description="max size of one safetensors shard in MiB (a single "
                                                 "larger tensor gets a shard of its own)")
    delta: bool = Field(False, description="write only tensors whose bytes changed since the last "
                                           "written version; the manifest points unchanged ones at "
                                           "the older version folder that holds them")
    keep: int = Field(2, ge=1, description="version folders kept on disk; folders the newest "
                                           "manifest still references are never deleted")
    verify: bool = Field(False, description="after each sync, compare every engine tensor's checksum "
                                            "with the manifest's (the trainer's); an in-process engine "
                                            "also checks each tensor as it reads it. Fails the run "
                                            "naming the first tensor that differs")
