"""Rollout ``verifiers``: episodes played by the verifiers worker against ``miles serve``.

The worker runs each task's episode in the verifiers environment, whose model calls reach the
policy's OpenAI-compatible server (``env.policy_url``, the server the engine's weights are
pushed to); it returns the task's reward and the policy's own token-level reply: prompt ids,
completion ids, per-token log-probs and the weight version. Those become the sample as they
are, so the trainer scores exactly the tokens the policy generated. An episode that fails in
the worker (policy error, timeout, a malformed reply) or a request the worker does not answer
in ``env.timeout_s`` gives ``Status.FAILED`` samples (loss_mask zeroed), excluded from training.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from miles import MilesError, Sample, SamplingParams, Task
from miles.protocols import ReceivesWeights, ServiceEnv
from miles.types import Status

from .client import WorkerError
from .config import VerifiersRolloutConfig


class VerifiersRollout:
    def __init__(self, cfg: VerifiersRolloutConfig):
        self.cfg = cfg

    def generate(self, tasks: Sequence[Task], n: int, *, engine: Any, env: Any, tokenizer: Any,
                 params: SamplingParams) -> list[list[Sample]]:
        if not (isinstance(env, ServiceEnv) and env.service == "verifiers"):
            raise MilesError("rollout.name: verifiers plays episodes in the verifiers worker: set env.name: verifiers")
        if engine is not None and not (isinstance(engine, ReceivesWeights) and engine.remote):
            # the worker samples from env.policy_url: an engine inside this process would never
            # pass the trained weights on to it
            raise MilesError(f"rollout verifiers: the policy is the `miles serve` at env.policy_url "
                             f"({env.cfg.policy_url}); set engine: {{name: sglang, urls: [{env.cfg.policy_url}]}} "
                             f"so every step's weights reach it")
        order = [t for t in tasks for _ in range(n)]
        answers: list[dict] = []
        step = self.cfg.episodes_per_request
        for i in range(0, len(order), step):
            answers += self._request(order[i:i + step], env, params)
        samples = [_sample(t, a, tokenizer) for t, a in zip(order, answers)]
        return [samples[i * n:(i + 1) * n] for i in range(len(tasks))]

    def _request(self, chunk: list[Task], env: Any, params: SamplingParams) -> list[dict]:
        sampling = {"temperature": params.temperature, "max_tokens": params.max_new_tokens}
        if params.top_p < 1.0:
            sampling["top_p"] = params.top_p
        body = {"policy_url": env.cfg.policy_url, "episodes": [{"idx": t.metadata["idx"]} for t in chunk],
                "sampling": sampling, "timeout_s": env.cfg.timeout_s}
        try:
            eps = env.worker.call("/rollout", body).get("episodes")
        except WorkerError as e:
            if "cannot reach" in str(e):  # a worker that is down ends the run with the fix named
                raise MilesError(f"rollout verifiers: {e}") from e
            return [{"error": str(e)}] * len(chunk)
        if not isinstance(eps, list) or len(eps) != len(chunk):
            return [{"error": f"the worker answered {len(eps) if isinstance(eps, list) else eps!r} episodes "
                              f"for {len(chunk)}"}] * len(chunk)
        return eps


def _checked(a: Any) -> str:
    """Why episode answer ``a`` cannot be trained on ('' when it can)."""
    if not isinstance(a, dict):
        return f"malformed episode {a!r:.200}"
    if a.get("error"):
        return str(a["error"])
    ids, lps, prompt = a.get("completion_ids"), a.get("logprobs"), a.get("prompt_ids")
    if not (isinstance(prompt, list) and prompt and isinstance(ids, list) and ids and isinstance(lps, list)
            and all(isinstance(t, int) for t in prompt + ids)):
        return f"episode without the policy's token ids: {str(a)[:200]}"
    if len(lps) != len(ids) or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in lps):
        return f"episode log-probs do not match its {len(ids)} tokens: {str(lps)[:200]}"
    r = a.get("reward")
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r):
        return f"episode reward {r!r} is not a number"
    return ""


def _sample(task: Task, a: Any, tokenizer: Any) -> Sample:
    error = _checked(a)
    if error:  # one masked stop token keeps the batch's shapes; nothing of it is trained on
        eos = tokenizer.eos_token_id
        return Sample(task=task, prompt_ids=list(tokenizer.encode(task.prompt, add_special_tokens=False)),
                      response_ids=[eos], response="", logprobs=[0.0], loss_mask=[0], reward=0.0,
                      status=Status.FAILED, extensions={"verifiers": {"error": error}})
    ids = list(a["completion_ids"])
    version = int(a.get("weight_version") or 0)
    return Sample(task=task, prompt_ids=list(a["prompt_ids"]), response_ids=ids,
                  response=tokenizer.decode(ids, skip_special_tokens=True), logprobs=[float(x) for x in a["logprobs"]],
                  loss_mask=[1] * len(ids), reward=float(a["reward"]),
                  status=Status.COMPLETED if a.get("finish_reason") == "stop" else Status.TRUNCATED,
                  weight_version=version, weight_versions=[version],
                  extensions={"verifiers": {"rewards": a.get("rewards") or {}, "text": a.get("text"), "error": ""}})


def metrics(samples: Sequence[Sample]) -> dict[str, float]:
    eps = [s.extensions.get("verifiers", {}) for s in samples]
    return {"env_failed": float(sum(bool(e.get("error")) for e in eps))} if eps else {}


VerifiersRollout.metrics = staticmethod(metrics)  # type: ignore[attr-defined]
