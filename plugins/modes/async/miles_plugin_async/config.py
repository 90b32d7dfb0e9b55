"""Settings of ``run.mode: async`` (pydantic only). They sit in the ``rollout`` section beside
the kernel's rollout keys; this schema owns them."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class AsyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_staleness: int = Field(1, ge=0, description="rollout workers generate no group that would be "
                               "more than this many weight versions old when trained on; groups that "
                               "still are get stale_policy")
    stale_policy: Literal["drop", "importance"] = Field("drop", description="groups older than "
                                                        "max_staleness are dropped, or kept "
                                                        "(importance-weighted like any stale sample)")
    correct_stale: bool = Field(True, description="samples from older weights than the trainer's are "
                                "trained with truncated importance weights min(pi/pi_rollout, "
                                "importance_cap) per token (decoupled PPO); false: as if on-policy")
    importance_cap: float = Field(2.0, gt=0, description="truncation of importance weights")
    buffer_groups: int | None = Field(None, gt=0, description="buffer capacity in groups "
                                      "(default 2 x batch_size)")
    async_workers: int = Field(2, gt=0, description="rollout threads, each keeping one request of up "
                               "to batch_size prompts in flight (pacing sizes it)")
    in_flight: Literal["finish", "resume"] = Field(
        "finish", description="requests in flight when new weights are pushed. finish: they end on "
        "the old weights; resume (partial rollout; engines in their own processes): they are aborted "
        "and continue from their tokens so far on the new weights (Sample.weight_versions)")
