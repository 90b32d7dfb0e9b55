from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _default_resources() -> dict[str, float]:
    return {"CPU": 1}


class ActorResources(BaseModel):
    """Ray resources one actor of each role holds (``CPU``, ``GPU``, ``memory`` or any custom
    resource a node was started with, e.g. ``{node_a: 1}`` to pin a role to a node)."""

    model_config = ConfigDict(extra="forbid")

    trainer: dict[str, float] = Field(default_factory=_default_resources,
                                      description="resources of each trainer rank's actor")
    engine: dict[str, float] = Field(default_factory=_default_resources,
                                     description="resources of each engine's actor")

    @field_validator("trainer", "engine")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in value.items() if v < 0}
        if bad:
            raise ValueError(f"resource amounts must be >= 0, got {bad}")
        if not any(v > 0 for v in value.values()):
            raise ValueError("give at least one positive resource (e.g. {CPU: 1}): Ray cannot "
                             "reserve an empty placement-group bundle")
        return value


class RayLauncherConfig(BaseModel):
    """Placement of one run on a Ray cluster.

    Every long-lived process is a named Ray actor: ``miles-trainer-R`` runs trainer rank R (``miles
    train`` with torchrun-style env) and ``miles-engine-I`` runs a ``miles serve`` engine server that
    trainer rank 0 drives over HTTP (the ``sglang`` engine client). Ray carries only control; weights
    move over the run's transport.
    """

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(None, description="Ray cluster to join: 'auto', 'ray://HOST:10001' or "
                                "'HOST:6379'; null starts a local Ray instance for this run and stops "
                                "it at the end")
    num_cpus: int | None = Field(None, gt=0, description="CPUs of the local Ray instance (address: null "
                                 "only; null = all cores)")
    num_gpus: int | None = Field(None, ge=0, description="GPUs of the local Ray instance (address: null "
                                 "only; null = detected)")
    dashboard: bool = Field(True, description="start Ray's dashboard with the local instance (address: "
                            "null), on 127.0.0.1: the state API (`ray list actors`) and the web UI")
    trainer_ranks: int = Field(1, gt=0, description="trainer actors (the FSDP2 world size)")
    engines: int = Field(1, ge=0, description="engine actors running `miles serve` (0 = engine inside "
                         "trainer rank 0)")
    resources: ActorResources = Field(default_factory=ActorResources,
                                      description="Ray resources per actor, by role: trainer, engine")
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="colocated: pack the actors on as few nodes as possible (PACK "
        "placement group); disaggregated: spread them over nodes (SPREAD)")
    max_engine_restarts: int = Field(3, ge=0, description="times an engine is restarted after its "
                                     "server process or actor dies (it gets the current weights and its "
                                     "requests are retried) before the run ends with an error")
    startup_timeout_s: float = Field(300.0, gt=0, description="time to place the actors, for an "
                                     "engine to become healthy and for the dashboard to answer")
    shutdown_grace_s: float = Field(60.0, gt=0, description="time trainers get to checkpoint and exit "
                                    "after Ctrl-C/SIGTERM before they are killed")
