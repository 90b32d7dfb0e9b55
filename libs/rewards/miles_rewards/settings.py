"""The settings of each built-in reward: strict pydantic models (an unknown key is an error), light
to import so config validation never loads a verifier library."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MathSettings(_Strict):
    timeout_s: int = Field(5, ge=0, description="seconds math-verify may spend parsing or comparing one answer "
                           "(signal-based, so only on the main thread; 0: no limit)")
    float_rounding: int = Field(6, ge=0, description="decimal places numbers are rounded to before comparing")
    numbers_only: bool = Field(True, description="a numeric label needs a number as the answer, not arithmetic "
                               "left to do: '59 + 63' or '3 \\cdot 4' scores 0 against 122 (math-verify would "
                               "evaluate it, and RL learns to copy the question); fractions and negatives count")


class ExactSettings(_Strict):
    case_sensitive: bool = Field(False, description="compare letter case too")
    ignore_punctuation: bool = Field(True, description="drop punctuation before comparing (and, always, "
                                     "surrounding whitespace and repeated spaces)")


class ChoiceSettings(_Strict):
    letters: str = Field("ABCDEFGHIJ", min_length=2, description="the option letters a response may name "
                         "(upper case); an integer label is an index into them (0 -> A)")


class RegexSettings(_Strict):
    pattern: str | None = Field(None, description="regular expression searched in the response (required); its "
                                "first group (or the whole match) is compared with the label, normalised as "
                                "'exact' does; with no label, a match scores 1")
    format_pattern: str | None = Field(None, description="optional format check: this pattern must match the "
                                       "whole response (re.fullmatch, DOTALL)")
    format_weight: float = Field(0.0, ge=0, le=1, description="share of the score given by format_pattern; "
                                 "the rest comes from the answer")
    case_sensitive: bool = Field(False, description="compare the extracted answer's letter case too")


class CodeSettings(_Strict):
    tests_key: str = Field("tests", description="metadata key of the row's tests (the label when absent): a list "
                           "of Python assert statements, or of {input, output} stdin/stdout pairs")
    setup_key: str = Field("test_setup", description="metadata key of optional code run before the tests")
    timeout_s: float = Field(10.0, gt=0, description="wall-clock limit of one sandbox run")
    memory_mb: int = Field(1024, gt=0, description="address-space limit of the code, in MB")
    max_tests: int = Field(50, gt=0, description="tests run per response at most (the rest count as failed)")


DEFAULT_JUDGE_TEMPLATE = (
    "You are grading an answer to a question.\n\nQuestion:\n{prompt}\n\nReference answer:\n{label}\n\n"
    "Answer to grade:\n{response}\n\nRate how correct the answer is from 0 to 10. End your reply with a "
    "line 'score: N'.")


class JudgeSettings(_Strict):
    base_url: str | None = Field(None, description="the OpenAI-compatible endpoint (required), e.g. "
                                 "http://127.0.0.1:8000/v1 for a miles serve or vLLM/SGLang server")
    model: str | None = Field(None, description="the judge model's name; default: the first of /v1/models")
    api_key_env: str | None = Field(None, description="environment variable holding the API key (default: "
                                    "none needed; the client sends 'EMPTY')")
    prompt_template: str = Field(DEFAULT_JUDGE_TEMPLATE, description="the judge's user message; {prompt}, "
                                 "{response} and {label} are filled in")
    system_prompt: str | None = Field(None, description="optional system message")
    score_pattern: str = Field(r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)", description="regex whose first group is "
                               "the score, taken from its last match in the judge's reply")
    max_score: float = Field(10.0, gt=0, description="the reward is the parsed score / max_score, clipped to [0, 1]")
    max_tokens: int = Field(256, gt=0, description="the judge's reply length limit")
    temperature: float = Field(0.0, ge=0, description="the judge's sampling temperature")
    timeout_s: float = Field(30.0, gt=0, description="limit of one request")
    retries: int = Field(2, ge=0, description="extra attempts after a connection error, a timeout, a 429 or a 5xx")
    backoff_s: float = Field(0.5, ge=0, description="wait before the first retry (doubling each time, up to 4 s)")
    failure_score: float = Field(0.0, description="the reward when the judge fails or its reply has no score")
    breaker_failures: int = Field(3, gt=0, description="failed calls in a row after which the judge is skipped "
                                  "for breaker_cooldown_s (each skipped sample gets failure_score), so a dead "
                                  "judge costs a step a few timeouts, never one per sample")
    breaker_cooldown_s: float = Field(60.0, ge=0, description="how long the judge is skipped after that")


SETTINGS: dict[str, type[BaseModel]] = {"math": MathSettings, "exact": ExactSettings, "choice": ChoiceSettings,
                                        "regex": RegexSettings, "code": CodeSettings, "judge": JudgeSettings}
