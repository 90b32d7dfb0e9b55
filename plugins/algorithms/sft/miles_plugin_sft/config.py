"""SFT configuration (pydantic only: importable without torch)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SFTConfig(BaseModel):
    """Settings of the ``sft`` algorithm (the ``algorithm:`` config section minus ``name``)."""

    model_config = ConfigDict(extra="forbid")

    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = Field("token-mean", description=(
        "How per-token negative log-likelihoods are averaged: 'token-mean' over every trainable "
        "token of the step (long demonstrations weigh more); 'seq-mean-token-mean' averages each "
        "demonstration's token-mean, so every demonstration weighs the same."))
    data: str | None = Field(None, description=(
        "A dataset file to train on (.jsonl/.json or .parquet, read with Hugging Face datasets): "
        "rows of prompt/response pairs or of chat messages. Unset: the env's demonstrations."))
    prompt_key: str = Field("prompt", description="column holding the prompt (text, or a list of "
                            "chat messages rendered with the tokenizer's chat template)")
    response_key: str = Field("response", description="column holding the target response text")
    messages_key: str = Field("messages", description=(
        "column holding a whole chat ([{role, content}, ...]) rendered with the tokenizer's chat "
        "template; the loss is on the assistant turns only. Used when the row has it."))
    label_key: str = Field("label", description="optional column with the verifier's label (so the "
                           "env can score the demonstration for reward_mean)")
    pack: bool = Field(False, description=(
        "Sequence packing: several examples share a row, each with its own position ids and a "
        "block-diagonal attention mask, so no token attends across examples."))
    pack_length: int = Field(512, gt=1, description="tokens per packed row (an example longer than "
                             "this gets a row of its own)")

    @model_validator(mode="after")
    def _packing_needs_token_mean(self) -> SFTConfig:
        if self.pack and self.loss_agg != "token-mean":
            raise ValueError("pack=true needs loss_agg='token-mean': a packed row holds several "
                             "examples, so a per-row mean is not a per-example mean")
        return self


class WarmStartConfig(BaseModel):
    """``run.warm_start``: supervised training on ``env.demonstrations()`` before RL, run to
    convergence: it stops when eval accuracy has not improved by ``min_delta`` for ``patience``
    evaluations. The kernel keeps the section as given; this plugin validates and runs it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_steps: int = Field(2000, gt=0, description="upper bound on supervised steps")
    min_steps: int = Field(0, ge=0, description="no early stop before this many steps")
    batch_size: int = Field(256, gt=0, description="demonstrations per step")
    eval_every: int = Field(50, gt=0, description="supervised steps between evaluations")
    patience: int = Field(4, gt=0, description="evaluations without improvement before stopping")
    min_delta: float = Field(0.005, ge=0, description="improvement that resets patience")
    algorithm: str = Field("sft", description="registered algorithm used for the warm start")
    trainer: dict[str, Any] = Field(default_factory=dict,
                                    description="trainer settings overridden during the warm start")
