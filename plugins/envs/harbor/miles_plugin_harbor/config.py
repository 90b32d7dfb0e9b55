from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

TASKS = Path(__file__).parent / "tasks"


class HarborConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    server_url: str = Field("http://127.0.0.1:8390", description="base URL of `harbor serve` (its "
                            "default port is 8390); `python -m miles_plugin_harbor.launch` starts one")
    api_key_env: str = Field("HARBOR_API_KEY", description="environment variable holding the server's "
                             "API key, sent as a bearer token when set (harbor serve needs one only "
                             "beyond localhost)")
    tasks_dir: str = Field(str(TASKS / "train"), description="folder of Harbor task folders (each with "
                           "task.toml, instruction.md, environment/, tests/), read by the server: a "
                           "path on the server's filesystem")
    eval_tasks_dir: str = Field(str(TASKS / "eval"), description="folder of Harbor task folders for evaluation")
    agent: dict[str, Any] = Field(default_factory=lambda: {"name": "oracle"}, description="Harbor "
                                  "AgentConfig of every trial: name (e.g. terminus-2 with model_name, "
                                  "base_url at miles serve's /v1 and kwargs.collect_rollout_details: "
                                  "true for token data; oracle runs each task's solution)")
    environment: dict[str, Any] = Field(default_factory=lambda: {"type": "podman"}, description="Harbor "
                                        "EnvironmentConfig of every trial (type: docker, podman, ...)")
    job_timeout_s: float = Field(900.0, gt=0, description="seconds one rollout batch (a Harbor job) may "
                                 "take; past it the job is cancelled and its unfinished trials fail")
    poll_interval_s: float = Field(1.0, gt=0, description="seconds between job status polls")
    request_timeout_s: float = Field(30.0, gt=0, description="seconds one HTTP request to the server may take")
    max_concurrent_trials: int = Field(4, gt=0, description="the job's n_concurrent_trials")
    jobs_dir: str | None = Field(None, description="where the server writes job folders (default: "
                                 "its own jobs/ folder)")
    chars: str = Field("0123456789+=/.abcdefghijklmnopqrstuvwxyz", min_length=1, description="characters "
                       "of the env's character-level tokenizer (the model spec's default tokenizer; with "
                       "an LLM agent on miles serve, use the served model's folder as model.path instead)")


class HarborRolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_failed_fraction: float = Field(0.5, ge=0, le=1, description="a batch in which more than this "
                                       "fraction of trials failed is an error, not a training step")
    require_token_data: bool = Field(True, description="a trial whose agent recorded no token ids and "
                                     "log-probs (rollout_details) is a failed sample; false keeps it "
                                     "with its reward and no trainable tokens (scoring a fixed policy)")
