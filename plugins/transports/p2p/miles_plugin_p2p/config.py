"""Config of the ``p2p`` transport. Kept free of torch and NIXL imports so registration stays cheap."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class P2PSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verify: bool = Field(False, description="after each sync, compare every engine tensor's checksum "
                                            "with the trainer's; fail the run naming the first "
                                            "tensor that differs")
    transport: Literal["tcp", "rdma", "auto"] = Field(
        "tcp", description="UCX transports of the NIXL agents: tcp (any host, no RDMA NIC needed), "
                           "rdma (InfiniBand/RoCE verbs; fails where no RDMA device exists), auto "
                           "(UCX picks, e.g. shared memory between processes of one host)")
    bucket_mb: float = Field(64, gt=0, description="max MiB of weights per write (one NIXL transfer "
                                                 "per bucket and engine rank)")
    workers: int = Field(4, ge=1, le=64, description="writes in flight at once (a thread pool; also "
                                                     "the number of registered send buffers when "
                                                     "tensors are packed)")
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="send floating-point weights as this dtype, e.g. the engines' bfloat16 "
                          "(written straight into their parameters); null = the trainer's own dtypes "
                          "(an engine of another dtype stages them and converts at commit)")
    pause: bool = Field(True, description="pause the engines' generation (in place: the batch in "
                                          "flight finishes) while weights are written into them")
    timeout_s: float = Field(120.0, gt=0, description="seconds one bucket's write may take before "
                                                      "the sync fails naming the engine and bucket")
