"""Rollout ``harbor``: one Harbor job per rollout batch, one trial per sample.

The job runs every task ``n`` times (``n_attempts``) with the configured agent and sandbox; the
rollout polls it until it ends or ``env.job_timeout_s`` passes (then cancels it), reads each
rollout's verifier reward and the agent's token data, and turns each trial into a sample. A
trial that errored, was cancelled, or has no usable reward or token data is a failed sample
(loss_mask zeroed, excluded from training); most of a batch failing is an error.
"""
from __future__ import annotations

import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from miles import MilesError, Sample, SamplingParams, Task
from miles.protocols import LoadsWeights, ServiceEnv
from miles.types import Status

from .client import TERMINAL, HarborClient, HarborError
from .config import HarborRolloutConfig
from .trajectory import BadTrial, parse_trial

PLUGIN = "harbor"
MILES_AGENT = "miles_harbor_agent:MilesAgent"  # agent/miles_harbor_agent.py, run inside Harbor


class HarborRollout:
    def __init__(self, cfg: HarborRolloutConfig):
        self.cfg = cfg

    def generate(self, tasks: Sequence[Task], n: int, *, engine: Any, env: Any, tokenizer: Any,
                 params: SamplingParams) -> list[list[Sample]]:
        if not (isinstance(env, ServiceEnv) and env.service == "harbor"):
            raise MilesError("rollout.name: harbor runs trials on the harbor env's server: set env.name: harbor")
        ecfg = env.cfg
        client = HarborClient(ecfg.server_url, timeout_s=ecfg.request_timeout_s, api_key_env=ecfg.api_key_env)
        try:
            details = run_job(client, job_config(ecfg, tasks, n, params), ecfg.job_timeout_s, ecfg.poll_interval_s)
        finally:
            client.close()
        by_task: dict[str, list[dict]] = defaultdict(list)
        for d in details:
            by_task[(d.get("task") or {}).get("name", "")].append(d)
        version = engine.weight_version if isinstance(engine, LoadsWeights) else 0
        groups = []
        for t in tasks:
            trials = by_task.get(t.metadata["name"], [])[:n]
            trials += [{"error_type": "NotRun", "result": None}] * (n - len(trials))
            groups.append([self._sample(t, d, tokenizer, version) for d in trials])
        failed = [s for g in groups for s in g if s.status == Status.FAILED]
        env.failures.extend(s.extensions[PLUGIN]["error"] for s in failed)
        if len(failed) > self.cfg.max_failed_fraction * n * len(tasks):
            raise MilesError(f"rollout harbor: {len(failed)} of {n * len(tasks)} trials failed "
                             f"(rollout.max_failed_fraction is {self.cfg.max_failed_fraction}); first: "
                             f"{failed[0].extensions[PLUGIN]['error']}")
        return groups

    def _sample(self, task: Task, detail: dict, tokenizer: Any, version: int) -> Sample:
        pad = getattr(tokenizer, "eos_token_id", None) or 0
        ext = {"rollout_id": detail.get("id"), "turns": 0, "error": ""}
        try:
            if detail.get("state") not in (None, "finished"):
                raise BadTrial(f"the trial ended {detail['state']}")
            t = parse_trial(detail, self.cfg.require_token_data)
        except BadTrial as e:
            # no tokens to train on: one masked placeholder token keeps the batch's shapes valid
            return Sample(task=task, prompt_ids=[pad], response_ids=[pad], logprobs=[0.0], loss_mask=[0],
                          reward=0.0, status=Status.FAILED, weight_version=version,
                          extensions={PLUGIN: {**ext, "error": str(e)}})
        ext["turns"] = t.turns
        if not t.response_ids:  # scored without token data (require_token_data: false)
            return Sample(task=task, prompt_ids=[pad], response_ids=[pad], logprobs=[0.0], loss_mask=[0],
                          reward=t.reward, weight_version=version, extensions={PLUGIN: ext})
        versions = sorted(set(t.weight_versions)) or [version]  # per turn, when the agent recorded them
        return Sample(task=task, prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                      response=tokenizer.decode(t.response_ids, skip_special_tokens=True), logprobs=t.logprobs,
                      loss_mask=t.loss_mask, reward=t.reward, weight_version=versions[0],
                      weight_versions=versions, extensions={PLUGIN: ext})

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        trials = [s.extensions.get(PLUGIN, {}) for s in samples]
        if not trials:
            return {}
        return {"turns_mean": sum(t.get("turns", 0) for t in trials) / len(trials),
                "env_failed": float(sum(bool(t.get("error")) for t in trials))}


def job_config(ecfg: Any, tasks: Sequence[Task], n: int, params: SamplingParams | None = None) -> dict:
    """The Harbor JobConfig of one rollout batch: every task, ``n`` attempts each."""
    config = {"job_name": f"miles-{uuid.uuid4().hex[:12]}", "n_attempts": n,
              "n_concurrent_trials": ecfg.max_concurrent_trials, "quiet": True,
              "tasks": [{"path": t.metadata["path"]} for t in tasks],
              "agents": [agent_config(ecfg.agent, params)], "environment": dict(ecfg.environment)}
    if ecfg.jobs_dir:
        config["jobs_dir"] = ecfg.jobs_dir
    return config


def agent_config(agent: dict, params: SamplingParams | None) -> dict:
    """``env.agent``; for the miles agent, with the rollout's sampling settings (greedy in
    evaluation) and its tokenizer folder as an absolute path (the server's working folder differs)."""
    agent = dict(agent)
    if MILES_AGENT not in (agent.get("import_path"), agent.get("name")):
        return agent
    kwargs = dict(agent.get("kwargs") or {})
    if kwargs.get("tokenizer_dir"):
        kwargs["tokenizer_dir"] = str(Path(kwargs["tokenizer_dir"]).expanduser().resolve())
    if params is not None:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                      max_new_tokens=params.max_new_tokens)
    return {**agent, "kwargs": kwargs}


def run_job(client: HarborClient, config: dict, timeout_s: float, poll_s: float) -> list[dict]:
    """Submit, wait for the job to end (cancelling it past ``timeout_s``), return its rollout details."""
    try:
        job_id = client.submit(config)["job_id"]
    except HarborError as e:
        raise MilesError(f"rollout harbor: the job was not accepted: {e}") from e
    deadline = time.monotonic() + timeout_s
    while client.job(job_id)["state"] not in TERMINAL:
        if time.monotonic() > deadline:
            client.cancel(job_id)  # unfinished trials come back cancelled: failed samples
            end = time.monotonic() + 60
            while client.job(job_id)["state"] not in TERMINAL and time.monotonic() < end:
                time.sleep(poll_s)
            break
        time.sleep(poll_s)
    return [client.rollout(r["id"]) for r in client.rollouts(job_id)]
