from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ToolUseConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    a_digits: int = Field(3, ge=1, le=6, description="digits of the first factor")
    b_digits: int = Field(2, ge=1, le=6, description="digits of the second factor")
    train_size: int = Field(4000, gt=0, description="training problems")
    eval_size: int = Field(200, gt=0, description="held-out problems for evaluation (never trained on)")
    teacher_tool_rate: float = Field(
        0.3, ge=0, le=1, description="how often the demonstrating teacher calls the calculator; otherwise "
        "it answers from a head estimate (the leading digits multiplied, the rest zeros), which is wrong")
    teacher_bad_call_rate: float = Field(
        0.3, ge=0, le=1, description="share of the teacher's calls that go wrong: half copy a factor "
        "with one digit mistyped (and answer the wrong result), half are malformed JSON (the tool "
        "answers with an error and the teacher falls back to its estimate)")
    demos_per_task: int = Field(2, gt=0, description="teacher transcripts per training problem, each "
                                "drawn independently")
    python_tool: Literal["auto", "off"] = Field(
        "auto", description="auto: also offer a 'python' tool (runs code through the miles-sandbox library's "
        "run_python) when that package is installed; off: the calculator only")
    python_timeout_s: float = Field(5.0, gt=0, description="wall-clock limit of one python tool call")
    data_seed: int = Field(1234, description="seed of the problems and of the teacher's choices "
                                             "(fixed across run seeds)")
