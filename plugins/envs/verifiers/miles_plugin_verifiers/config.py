from pydantic import BaseModel, ConfigDict, Field


class VerifiersConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    worker_url: str = Field("http://127.0.0.1:8100", description="URL of the verifiers worker "
                            "(worker/server.py, started with the virtualenv's python from scripts/make_venv.sh)")
    policy_url: str = Field("http://127.0.0.1:30000", description="URL of the `miles serve` that holds "
                            "the policy (the sglang engine's url); the worker's verifiers client calls its "
                            "/v1/chat/completions")
    train_size: int = Field(256, gt=0, description="train tasks: the worker taskset's first N rows")
    eval_size: int = Field(64, gt=0, description="eval tasks: N rows after the train rows (disjoint)")
    timeout_s: float = Field(120.0, gt=0, description="seconds one episode may take in the worker "
                             "(past it that sample is marked failed); a request to the worker waits "
                             "this plus reply_grace_s, then all of its samples are marked failed")
    reply_grace_s: float = Field(10.0, ge=0, description="extra seconds the connector waits for the "
                                 "worker's answer beyond timeout_s")
    connect_timeout_s: float = Field(10.0, gt=0, description="seconds to reach the worker")
    chars: str = Field("0123456789+=", min_length=1, description="characters of the character-level "
                       "tokenizer (the model spec's default); `miles serve`'s folder is written with "
                       "the same one (python -m miles_plugin_verifiers.policy)")


class VerifiersRolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episodes_per_request: int = Field(64, gt=0, description="episodes sent to the worker in one "
                                      "HTTP request (the worker runs them concurrently)")
