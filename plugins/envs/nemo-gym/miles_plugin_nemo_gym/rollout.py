"""Rollout ``nemo-gym``: each sample is one trajectory of a NeMo Gym agent server.

The task's row (its ``responses_create_params`` with this step's temperature, top_p and output
limit) goes to the agent's ``POST /run``; the agent plays the episode against its model server
(which calls the policy served by ``miles serve``) and its resources server, and answers the
verified reward with every model call's token ids and log-probs. A trajectory that fails (HTTP
error, timeout, malformed answer) becomes a ``Status.FAILED`` sample with loss_mask zeroed,
excluded from training; a batch where most fail, or an agent that cannot be reached, is an error.
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

from miles import MilesError, Sample, SamplingParams, Task
from miles.protocols import LoadsWeights, ServiceEnv
from miles.types import Status

from .client import AgentDown, run_all
from .config import NemoGymRolloutConfig
from .trajectory import parse_run

PLUGIN = "nemo-gym"


class NemoGymRollout:
    def __init__(self, cfg: NemoGymRolloutConfig):
        self.cfg = cfg

    def generate(self, tasks: Sequence[Task], n: int, *, engine: Any, env: Any, tokenizer: Any,
                 params: SamplingParams) -> list[list[Sample]]:
        if not (isinstance(env, ServiceEnv) and env.service == "nemo-gym"):
            raise MilesError("rollout.name: nemo-gym runs trajectories on the nemo-gym env's agent "
                             "server: set env.name: nemo-gym")
        ecfg = env.cfg
        bodies = [request_body(t.metadata["row"], params) for t in tasks for _ in range(n)]
        answers = run_all(ecfg.agent_url, bodies, timeout_s=ecfg.timeout_s,
                          connect_timeout_s=ecfg.connect_timeout_s, max_concurrency=ecfg.max_concurrency)
        down = [a for a in answers if isinstance(a, AgentDown)]
        if down and len(down) == len(answers):
            raise MilesError(f"rollout nemo-gym: {down[0]}")
        version = engine.weight_version if isinstance(engine, LoadsWeights) else 0
        samples = [to_sample(t, a, tokenizer, version) for t, a in
                   zip((t for t in tasks for _ in range(n)), answers)]
        failed = [s for s in samples if s.status == Status.FAILED]
        env.failures.extend(s.extensions[PLUGIN]["error"] for s in failed)
        if len(failed) > self.cfg.max_failed_fraction * len(samples):
            raise MilesError(f"rollout nemo-gym: {len(failed)} of {len(samples)} trajectories from "
                             f"{ecfg.agent_url} failed (rollout.max_failed_fraction is "
                             f"{self.cfg.max_failed_fraction}); first: {failed[0].extensions[PLUGIN]['error']}")
        return [samples[i * n:(i + 1) * n] for i in range(len(tasks))]

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        runs = [s.extensions.get(PLUGIN, {}) for s in samples]
        if not runs:
            return {}
        return {"turns_mean": sum(r.get("turns", 0) for r in runs) / len(runs),
                "env_failed": float(sum(bool(r.get("error")) for r in runs))}


def request_body(row: dict, params: SamplingParams) -> dict:
    """The task's row with this step's sampling settings in its ``responses_create_params``."""
    body = copy.deepcopy(row)
    rcp = body.setdefault("responses_create_params", {})
    rcp.update(temperature=params.temperature, top_p=params.top_p, max_output_tokens=params.max_new_tokens)
    return body


def to_sample(task: Task, answer: Any, tokenizer: Any, version: int) -> Sample:
    """The trajectory as a sample, or a failed sample (no loss, reward 0) saying what went wrong."""
    try:
        if isinstance(answer, BaseException):
            raise answer
        t = parse_run(answer)
    except Exception as e:  # each trajectory fails alone (MalformedTrajectory, RunFailed, timeouts)
        reason = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} (no answer in time)"
        # no tokens came back: one masked placeholder token keeps the batch's shapes valid
        pad = getattr(tokenizer, "eos_token_id", None) or 0
        return Sample(task=task, prompt_ids=[pad], response_ids=[pad], logprobs=[0.0], loss_mask=[0],
                      reward=0.0, status=Status.FAILED, weight_version=version,
                      extensions={PLUGIN: {"turns": 0, "error": reason}})
    status = Status.TRUNCATED if t.truncated else Status.COMPLETED
    text = t.text if t.text else tokenizer.decode(t.response_ids, skip_special_tokens=True)
    return Sample(task=task, prompt_ids=t.prompt_ids, response_ids=t.response_ids, response=text,
                  logprobs=t.logprobs, loss_mask=t.loss_mask, reward=t.reward, status=status,
                  weight_version=version, weight_versions=[version],
                  extensions={PLUGIN: {"turns": t.turns, "error": "", "reward": t.reward}})
