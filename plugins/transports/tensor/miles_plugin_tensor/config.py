"""Config of the ``tensor`` transport. Kept free of torch imports so registration stays cheap."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TensorSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verify: bool = Field(False, description="after each sync, compare every engine tensor's checksum "
                                            "with the trainer's; fail the run naming the first "
                                            "tensor that differs")
    bucket_mb: int = Field(512, ge=1, description="max MiB handed to an engine process per call "
                                                  "(bounds the shared memory / GPU memory in flight)")
    adopt: bool = Field(True, description="engines in another process on this host make their CPU "
                                          "parameters of the trainer's dtype views of the shared "
                                          "memory segments (no copy on their side; the trainer keeps "
                                          "two segment sets, i.e. 2x the weights in /dev/shm); false: "
                                          "engines copy out of one segment set")
