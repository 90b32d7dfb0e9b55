"""Config of the ``broadcast`` transport. Kept free of torch imports so registration stays cheap."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class BroadcastSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verify: bool = Field(False, description="after each sync, compare every engine tensor's checksum "
                                            "with the trainer's; fail the run naming the first "
                                            "tensor that differs")
    bucket_mb: int = Field(512, ge=1, description="max MiB of weights announced to the engines per "
                                                  "update_weights_from_distributed call")
    pack_mb: float | None = Field(None, ge=0, description="tensors below this size share one packed "
                                  "broadcast per bucket; larger ones are broadcast on their own, "
                                  "straight from the trainer's tensor into the engine's parameter. "
                                  "None: 1 MiB with gloo; with NCCL every tensor (one broadcast per "
                                  "bucket, which a torch engine receives straight into its parameters "
                                  "from the second sync on); 0: one broadcast per tensor (what SGLang "
                                  "servers expect)")
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="send floating-point weights as this dtype, e.g. the engines' bfloat16 "
                          "(half the bytes of float32 master weights, and received in place); null = "
                          "the trainer's own dtypes")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl when the "
                                                     "trainer's weights are on a GPU, else gloo. "
                                                     "NCCL needs the engines on other GPUs than "
                                                     "trainer rank 0 (one GPU shared: use "
                                                     "transport.name=tensor)")
    master_address: str = Field("127.0.0.1", description="address at which engines reach trainer "
                                "rank 0 (set this host's IP when engines run on other machines)")
    master_port: int = Field(0, ge=0, le=65535, description="rendezvous port on trainer rank 0; 0 "
                             "picks a free one")
    timeout_s: float = Field(600.0, gt=0, description="seconds to wait for engines to join the "
                             "group or to take part in a broadcast before failing the run")
