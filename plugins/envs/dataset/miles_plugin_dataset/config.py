from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class DatasetConfig(BaseModel):
    """The ``env:`` keys of ``env.name: dataset``."""

    model_config = ConfigDict(extra="forbid")

    train_files: list[str] = Field(..., min_length=1, description="training prompt files: .jsonl, .json, .parquet "
                                   "or .arrow (one row per prompt), read with Hugging Face datasets")
    eval_files: list[str] | None = Field(None, description="held-out prompt files for evaluation; without them "
                                         "eval_fraction of the training rows is held out")
    eval_fraction: float = Field(0.05, gt=0, lt=1, description="share of the training rows held out for "
                                 "evaluation (at least one row) when eval_files is not given")
    eval_limit: int | None = Field(None, gt=0, description="evaluate on at most this many eval prompts (the "
                                   "first of the seeded shuffle)")
    prompt_key: str = Field("prompt", description="column of the prompt: text, or chat messages (a list of "
                            "{role, content}); a dotted path reads a nested field")
    label_key: str | None = Field("answer", description="column of the reference answer the reward compares "
                                  "with (dotted path for nested fields, e.g. reward_model.ground_truth); "
                                  "null for rewards that need none")
    metadata_keys: list[str] | None = Field(None, description="columns passed to the reward as metadata (e.g. "
                                            "tests for code); default: every column but the prompt and label")
    system_prompt: str | None = Field(None, description="a system message put before every prompt (with "
                                      "chat_template: false, a line of text before it)")
    prompt_template: str = Field("{prompt}", description="the user message made of a text prompt; {prompt} is "
                                 "replaced, e.g. '{prompt}\\nPut the final answer in \\\\boxed{}.'")
    chat_template: bool = Field(True, description="true: prompts are chat messages rendered by the tokenizer's "
                                "chat template; false: raw text prompts, as written")
    max_prompt_tokens: int | None = Field(None, gt=0, description="drop prompts longer than this many tokens "
                                          "(after the chat template); the count dropped is printed")
    reward: Literal["math", "exact", "choice", "regex", "code", "judge"] = Field(
        "math", description="built-in reward (miles-rewards); a miles_reward plugin still overrides it")
    reward_settings: dict[str, Any] = Field(default_factory=dict, validate_default=True, description="the "
                                            "reward's own settings, e.g. {pattern: ...} for regex, {base_url: "
                                            "...} for judge")
    tools: list[Literal["python"]] = Field(default_factory=list, description="tools offered to a multi_turn "
                                           "rollout: python runs the model's code in the miles-sandbox")
    python_timeout_s: float = Field(5.0, gt=0, description="wall-clock limit of one python tool call")
    shuffle: bool = Field(True, description="shuffle the rows by seed (data_seed, else run.seed) before the "
                          "eval split is held out, and each training epoch's order by run.seed; false: "
                          "file order, every epoch")
    data_seed: int | None = Field(None, description="seed of the shuffle and the held-out split (default: run.seed)")

    @field_validator("train_files", "eval_files", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("reward_settings")
    @classmethod
    def _reward_settings(cls, v: dict, info: ValidationInfo) -> dict:
        from miles_rewards import validate_settings

        if "reward" in info.data:  # else the reward itself is the problem reported
            validate_settings(info.data["reward"], v)
        return v
