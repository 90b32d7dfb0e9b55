from pydantic import BaseModel, ConfigDict, Field, model_validator


class LocalLauncherConfig(BaseModel):
    """Placement of one run on this machine.

    ``engines: 0`` keeps the engine inside trainer rank 0 (colocated in one process, as without a
    launcher); ``engines: N`` starts N ``miles serve`` workers that trainer rank 0 drives over
    HTTP (the ``sglang`` engine client). Devices are CUDA indices; leave them out for CPU.
    Trainer and engine devices may overlap (colocated on GPUs) or not (disaggregated).
    """

    model_config = ConfigDict(extra="forbid")

    trainer_ranks: int = Field(1, gt=0, description="trainer processes (the FSDP2 world size)")
    engines: int = Field(1, ge=0, description="engine worker processes (0 = engine inside trainer rank 0)")
    trainer_devices: list[int] | None = Field(None, description="CUDA device of each trainer rank (null = CPU)")
    engine_devices: list[int] | None = Field(None, description="CUDA device of each engine (null = CPU)")
    host: str = Field("127.0.0.1", description="address the engine workers bind")
    engine_threads: int | None = Field(None, gt=0, description="torch CPU threads per engine worker")
    max_engine_restarts: int = Field(3, ge=0, description="times a dead engine worker is restarted "
                                     "(it gets the current weights and its requests are retried) "
                                     "before the run ends with an error")
    startup_timeout_s: float = Field(300.0, gt=0, description="time an engine may take to become healthy")
    shutdown_grace_s: float = Field(60.0, gt=0, description="time trainers get to checkpoint and exit "
                                    "after Ctrl-C/SIGTERM before they are killed")

    @model_validator(mode="after")
    def _loopback_host(self):
        # every process of a local launch is on this machine, and its engine workers take no API key
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.host.startswith("127."):
            raise ValueError(f"host {self.host!r} would expose the engine workers beyond this machine without "
                             f"an API key; the local launcher runs every process here, so keep 127.0.0.1")
        return self

    @model_validator(mode="after")
    def _devices_match(self):
        if self.trainer_devices is not None and len(self.trainer_devices) != self.trainer_ranks:
            raise ValueError(f"trainer_devices lists {len(self.trainer_devices)} devices for "
                             f"{self.trainer_ranks} trainer_ranks; give one per rank")
        if self.engine_devices is not None and len(self.engine_devices) != self.engines:
            raise ValueError(f"engine_devices lists {len(self.engine_devices)} devices for "
                             f"{self.engines} engines; give one per engine")
        return self
