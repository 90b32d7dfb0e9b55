from pydantic import BaseModel, ConfigDict, Field


class OpenEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_url: str = Field("http://127.0.0.1:8000", description="URL of the OpenEnv server (create_app "
                          "under uvicorn); its WebSocket endpoint /ws keeps one episode per connection")
    train_seeds: int = Field(64, gt=0, description="train tasks: episodes reset with seeds 0..N-1")
    eval_seeds: int = Field(16, gt=0, description="eval tasks: episodes reset with seeds "
                            "1000000..1000000+N-1 (disjoint from the train seeds)")
    connect_timeout_s: float = Field(10.0, gt=0, description="seconds to open a WebSocket session")
    message_timeout_s: float = Field(30.0, gt=0, description="seconds to wait for one reset/step "
                                     "answer; past it the episode's sample is marked failed")
    prompt_field: str = Field("prompt", description="observation field (after reset) holding the task "
                              "prompt text")
    feedback_field: str = Field("hint", description="observation field (after a step) holding the "
                                "text shown to the model before its next turn")
    reference_field: str = Field("reference", description="observation field (after reset) holding a "
                                 "reference answer, the demonstrations of run.warm_start (optional)")
    action_field: str = Field("message", description="action field the model's text goes into")
    chars: str = Field("0123456789+-=^v?", min_length=1, description="characters of the env's "
                       "character-level tokenizer (the model spec's default tokenizer)")


class OpenEnvRolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(3, ge=1, le=64, description="model turns per episode at most (the "
                           "episode ends earlier when the server says done)")
    turn_separator: str = Field("", description="text put between the env's observation and the "
                                "model's next turn (masked like the observation)")
