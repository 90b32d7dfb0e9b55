from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ArithConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["plain", "chat"] = Field(
        "plain", description="plain: character prompts (07+45=) answered with the zero-padded result, "
        "for a model over the env's own character tokenizer; chat: a question in chat messages, put "
        "through the model tokenizer's chat template, answered in free text and graded by its final "
        "number (a \\boxed{} one or the last), for a pretrained chat model")
    op: Literal["+", "-", "*"] = Field("+", description="the operation (chat format; plain is addition)")
    instruction: str = Field("Put the final answer in \\boxed{}.", description="chat format: the "
                             "sentence after each question")
    system_prompt: str | None = Field(None, description="chat format: a system message before each "
                                      "question (null: none, the chat template's default applies)")

    digits: int = Field(2, ge=1, le=4, description="digits per operand (zero-padded)")
    eval_size: int = Field(500, gt=0, description="held-out problems for evaluation (never trained on)")
    teacher_carry_accuracy: float = Field(
        0.3, ge=0, le=1, description="how often the demonstrating teacher gets a problem with a units "
        "carry right; otherwise it forgets the carry (answers a+b-10). Problems without a units carry "
        "are always right.")
    demos_per_task: int = Field(4, gt=0, description="teacher answers per training problem, each drawn "
                                "independently (so the teacher's carry mistakes are noise to imitate, "
                                "not labels to memorise)")
    data_seed: int = Field(1234, description="seed of the train/eval split and of the teacher's "
                                             "mistakes (fixed across run seeds)")
    export_dir: str | None = Field(None, description="write the data out as dataset files when the env "
                                   "is built: <dir>/train.jsonl (the teacher's demonstrations) and "
                                   "<dir>/eval.jsonl (held-out problems); kept if already written "
                                   "with the same settings (see python -m miles_plugin_arith.export_data)")

    @model_validator(mode="after")
    def _format_fits(self):
        if self.format == "plain" and self.op != "+":
            raise ValueError(f"env.op {self.op!r} needs env.format: chat (plain prompts are additions "
                             f"with zero-padded sums)")
        if self.format == "chat" and self.export_dir:
            raise ValueError("env.export_dir writes the plain format's demonstrations; the chat format "
                             "has none (leave export_dir out)")
        return self
