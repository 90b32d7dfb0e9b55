from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class MultiTurnConfig(BaseModel):
    """The ``rollout:`` keys of ``rollout.name: multi_turn`` (beside the kernel's own keys)."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(4, gt=0, description="model turns per sample; a sample whose last allowed turn "
                           "still calls a tool ends truncated")
    max_total_tokens: int = Field(1024, gt=0, description="token budget of a sample: prompt + every model "
                                  "and tool token; reaching it ends the sample truncated (keep it within "
                                  "the model's context length)")
    tool_format: Literal["hermes", "function_tag"] = Field(
        "hermes", description="how the model writes a tool call: hermes = <tool_call>{\"name\": ..., "
        "\"arguments\": {...}}</tool_call> (Qwen/Hermes); function_tag = <function=NAME>{...}</function> "
        "(Llama 3.1 custom tools)")
    chat_template: Literal["auto", "never"] = Field(
        "auto", description="auto: tool results are framed by the tokenizer's chat template (role 'tool') "
        "when it has one; never: always use tool_result_template")
    tool_result_template: str = Field(
        "<tool_response>{output}</tool_response>", description="plain-text frame of one tool result, "
        "used when the tokenizer has no chat template; {output} is replaced by the tool's output")
    max_tool_output_chars: int = Field(2000, gt=0, description="a tool's output is cut to this many "
                                       "characters before it is framed")
    show: int = Field(0, ge=0, description="print this many trajectories (prompt, each turn, tool calls and "
                      "results, answer, reward) of every rollout whose metrics are taken: each step and "
                      "each evaluation; e.g. miles eval CONFIG rollout.show=2")
