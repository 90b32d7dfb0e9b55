"""Built-in defaults, registered through the same hooks as any plugin: the single-turn rollout
(``trylast``), the ``sync`` run mode and the ``console`` and ``jsonl`` metric sinks."""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .hookspecs import hookimpl
from .types import Group, SamplingParams, Sample, Status, Task


def encode_prompts(tokenizer: Any, prompts: list) -> list[list[int]]:
    """Token ids of task prompts: chat messages through the chat template, text as is (an all-text
    batch in one tokenizer call)."""
    if all(isinstance(p, str) for p in prompts):
        return [list(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() is its keys
    return [list(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
            if isinstance(p, list) else list(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]


def decode_batch(tokenizer: Any, ids: list[list[int]]) -> list[str]:
    """Texts of many responses; a fast tokenizer's Rust backend skips transformers' per-list
    conversions, which cost more than the decoding itself for short responses."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch(ids, skip_special_tokens=True)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def single_turn(tasks: list[Task], n: int, engine: Any, tokenizer: Any, params: SamplingParams) -> list[list[Sample]]:
    """Generate ``n`` samples for each task in one batched engine call."""
    prompts = encode_prompts(tokenizer, [t.prompt for t in tasks])
    outs = engine.generate(prompts, params, n=n)
    texts = iter(decode_batch(tokenizer, [c.token_ids for cs in outs for c in cs]))
    return [[Sample(task=task, prompt_ids=prompt_ids, response_ids=c.token_ids, response=next(texts),
                    logprobs=c.logprobs, weight_version=c.weight_version,
                    weight_versions=c.weight_versions or [c.weight_version],
                    status=Status.COMPLETED if c.finish_reason == "stop" else Status.TRUNCATED)
             for c in completions]
            for task, prompt_ids, completions in zip(tasks, prompts, outs)]


@hookimpl(trylast=True)
def miles_rollout(task, n, engine, env):
    """Default: one single-turn generation of ``n`` samples (the loop batches these calls)."""
    return single_turn([task], n, engine, engine.tokenizer, engine.sampling_params)[0]


class SyncMode:
    """``run.mode: sync``: roll out, train, push the new weights, in that order: every sample is
    exactly on-policy. Every call happens on the trainer's thread (see ``miles.protocols.Mode``)."""

    def __init__(self, cfg: Any = None, *, loop: Any):
        self.loop = loop

    def take(self, rng: random.Random, params: SamplingParams) -> tuple[list[Group], dict[str, Any]]:
        """Roll out until ``rollout.batch_size`` groups pass the filters (bounded refill)."""
        loop, r, t0 = self.loop, self.loop.cfg.rollout, time.perf_counter()
        kept, sampled, dropped = [], [], 0
        for _ in range(r.oversample_rounds + 1):
            tasks = rng.sample(loop.train_tasks, min(r.batch_size - len(kept), len(loop.train_tasks)))
            groups = loop.rollout(tasks, r.n, params)
            sampled += groups
            for g in groups:
                if loop.keep(g):
                    kept.append(g)
                else:
                    dropped += 1
            if len(kept) >= r.batch_size:
                break
        t_roll = time.perf_counter()
        samples = [s for g in sampled for s in g.samples]
        return kept, {
            "reward_mean": sum(s.reward for s in samples) / len(samples), "staleness_mean": 0.0,
            "groups_kept": len(kept), "groups_dropped": dropped,
            "response_length_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "tokens_per_second": sum(len(s.response_ids) for s in samples) / max(t_roll - t0, 1e-9),
            "rollout_seconds": t_roll - t0}

    def push(self, trainer: Any, engines: list, version: int, wait: bool = True) -> dict[str, float]:
        return self.loop.p.transport.sync(trainer, engines, version)

    def finish_push(self) -> dict[str, float]:
        return {}

    def reweight(self, batch: Any, logprobs: Any) -> tuple[Any, dict[str, float]]:
        return batch, {}

    def lock_engines(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


@hookimpl
def miles_register_modes(register):
    register("sync", SyncMode)


class ConsoleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    every: int = Field(1, gt=0, description="print every N steps (evaluations always print)")


class ConsoleLogger:
    """One rich line per step: reward, accuracy, tokens/s, ETA."""

    def __init__(self, cfg: ConsoleConfig | None = None, *, total_steps: int = 0, **_):
        from rich.console import Console

        self.every = cfg.every if cfg else 1
        self.total = total_steps
        self.console = Console(highlight=False)
        self.t0 = time.perf_counter()
        self.first_step: int | None = None

    def log(self, step: int, m: dict[str, Any]) -> None:
        if step and self.first_step is None:
            self.first_step, self.t0 = step, time.perf_counter()
        if step % self.every and "eval_accuracy" not in m and step != self.total:
            return
        parts = [f"[bold]step {step}/{self.total}[/]"]
        for key, label, fmt in (("reward_mean", "reward", ".3f"), ("eval_accuracy", "eval_acc", ".3f"),
                                ("tokens_per_second", "tok/s", ",.0f"), ("step_seconds", "s/step", ".2f")):
            if key in m:
                parts.append(f"{label} {m[key]:{fmt}}")
        if step and self.first_step is not None and step > self.first_step and self.total > step:
            rate = (time.perf_counter() - self.t0) / (step - self.first_step)
            eta = rate * (self.total - step)
            parts.append(f"ETA {int(eta // 60)}m{int(eta % 60):02d}s" if eta >= 60 else f"ETA {eta:.0f}s")
        self.console.print("  ".join(parts))

    def close(self) -> None:
        pass


class JsonlLogger:
    """Appends one JSON object per step to ``out_dir/metrics.jsonl`` (flushed every line)."""

    def __init__(self, cfg: Any = None, *, out_dir: str, filename: str = "metrics.jsonl", **_):
        os.makedirs(out_dir, exist_ok=True)
        self.f = open(os.path.join(out_dir, filename), "a")

    def log(self, step: int, m: dict[str, Any]) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in m.items()}}
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


@hookimpl
def miles_register_loggers(register):
    register("console", ConsoleLogger, config=ConsoleConfig)
    register("jsonl", JsonlLogger)
