"""``judge``: an LLM grades the response through any OpenAI-compatible chat endpoint (``miles serve``,
vLLM, SGLang, a hosted API), with the official ``openai`` client.

A step never stalls on the judge: each request has a timeout, transient failures (connection
errors, timeouts, 429, 5xx) get a bounded number of retries with capped backoff, and after
``breaker_failures`` failed calls in a row the judge is skipped for ``breaker_cooldown_s``
(those samples get ``failure_score``, counted in ``judge_skipped``).
"""
from __future__ import annotations

import os
import re
import threading
import time
from typing import Any, Mapping

from .base import RewardConfigError, RewardResult
from .settings import JudgeSettings


def render_prompt(prompt: Any) -> str:
    """A task prompt as text: chat messages become ``role: content`` lines."""
    if isinstance(prompt, (list, tuple)):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" if isinstance(m, Mapping) else str(m)
                         for m in prompt)
    return "" if prompt is None else str(prompt)


class JudgeReward:
    """The judge's parsed score / ``max_score``, clipped to [0, 1] (see the module docstring)."""

    name = "judge"
    metric_names = ("judge_errors", "judge_parse_failures", "judge_retries", "judge_skipped", "judge_seconds")

    def __init__(self, cfg: JudgeSettings) -> None:
        import openai  # imported here: only this reward talks to a server

        try:
            self.score_re = re.compile(cfg.score_pattern)
        except re.error as e:
            raise RewardConfigError(f"reward 'judge': score_pattern {cfg.score_pattern!r} is not a valid "
                                    f"regular expression ({e})") from None
        key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else "EMPTY"
        if cfg.api_key_env and not key:
            raise RewardConfigError(f"reward 'judge': api_key_env names {cfg.api_key_env}, which is not set; "
                                    f"export it or remove api_key_env")
        self.cfg, self._openai = cfg, openai
        # retries are ours (counted, capped backoff); the client makes one attempt per call
        self.client = openai.OpenAI(base_url=cfg.base_url, api_key=key, timeout=cfg.timeout_s, max_retries=0)
        self._model = cfg.model
        self._lock = threading.Lock()
        self._failures_in_a_row = 0
        self._skip_until = 0.0

    def parse_score(self, text: str) -> float | None:
        """The last ``score_pattern`` match in ``text`` / ``max_score``, clipped to [0, 1]; None if none."""
        found = self.score_re.findall(text or "")
        if not found:
            return None
        last = found[-1] if isinstance(found[-1], str) else found[-1][0]
        try:
            value = float(last)
        except ValueError:
            return None
        return min(max(value / self.cfg.max_score, 0.0), 1.0)

    def messages(self, response: str, label: Any, prompt: Any) -> list[dict]:
        text = (self.cfg.prompt_template.replace("{prompt}", render_prompt(prompt))
                .replace("{label}", "" if label is None else str(label)).replace("{response}", response))
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return system + [{"role": "user", "content": text}]

    def __call__(self, response: str, label: Any = None, metadata: Mapping[str, Any] | None = None, *,
                 prompt: Any = None) -> RewardResult:
        t0 = time.monotonic()
        metrics = dict.fromkeys(self.metric_names, 0.0)
        with self._lock:
            skip = time.monotonic() < self._skip_until
        if skip:
            metrics["judge_skipped"] = 1.0
            return RewardResult(self.cfg.failure_score, metrics)
        reply, retries = self._ask(self.messages(response, label, prompt))
        metrics["judge_retries"] = float(retries)
        score = None if reply is None else self.parse_score(reply)
        metrics["judge_errors"] = float(reply is None)
        metrics["judge_parse_failures"] = float(reply is not None and score is None)
        self._record(reply is not None)
        metrics["judge_seconds"] = time.monotonic() - t0
        return RewardResult(self.cfg.failure_score if score is None else score, metrics, response.strip() or None)

    def _record(self, ok: bool) -> None:
        with self._lock:
            self._failures_in_a_row = 0 if ok else self._failures_in_a_row + 1
            if self._failures_in_a_row >= self.cfg.breaker_failures:
                self._skip_until = time.monotonic() + self.cfg.breaker_cooldown_s
                self._failures_in_a_row = 0

    def _ask(self, messages: list[dict]) -> tuple[str | None, int]:
        """The judge's reply text (None after the last failed attempt) and the retries made."""
        o = self._openai
        transient = (o.APIConnectionError, o.APITimeoutError, o.RateLimitError, o.InternalServerError)
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(min(self.cfg.backoff_s * 2 ** (attempt - 1), 4.0))
            try:
                r = self.client.chat.completions.create(
                    model=self.model(), messages=messages, max_tokens=self.cfg.max_tokens,
                    temperature=self.cfg.temperature)
                return (r.choices[0].message.content or "") if r.choices else "", attempt
            except transient:
                continue
            except o.APIError:  # 4xx other than 429: retrying would not help
                return None, attempt
        return None, self.cfg.retries

    def model(self) -> str:
        """The configured model, else the first the server lists (asked once)."""
        if self._model is None:
            self._model = self.client.models.list().data[0].id
        return self._model
