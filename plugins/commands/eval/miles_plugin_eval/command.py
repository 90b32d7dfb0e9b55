"""``miles eval``: the run is built as ``miles train`` builds it (same config, overrides and
launch-time plugins), its trainer loads the newest checkpoint and pushes the weights to the engine,
and the eval split is rolled out through the run's own rollout service: greedy by default (the
figures of the run's ``eval_*`` metrics), or ``--samples N`` per prompt at the rollout temperature
for pass@k and maj@k."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from typing import Any

import miles.runfolder as runfolder

from .scoring import summarize


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("config", help="YAML config file")
    sp.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    sp.add_argument("--samples", type=int, metavar="N", help="samples per eval prompt, drawn at the rollout "
                    "temperature (default: one greedy sample)")
    sp.add_argument("--k", type=int, action="append", metavar="K", help="k of pass@k and maj@k (repeatable; "
                    "default: N; k=1 is always reported)")
    sp.add_argument("--temperature", type=float, help="sampling temperature with --samples (default: "
                    "rollout.temperature)")
    sp.add_argument("--limit", type=int, metavar="M", help="evaluate the first M eval prompts only")
    sp.add_argument("--show", type=int, default=0, metavar="N", help="print N prompts with their responses, "
                    "answers and rewards")
    sp.add_argument("--untrained", action="store_true", help="evaluate the initial model when run.out_dir "
                    "holds no checkpoint (a baseline), instead of refusing")
    runfolder.add_trust_flag(sp)


def _check(args: argparse.Namespace) -> tuple[int, list[int]]:
    from miles import MilesError

    n = args.samples if args.samples is not None else max(args.k or [1])
    ks = sorted({1, *(args.k or [n])})
    bad = [f"--{name} must be positive (got {v})" for name, v in (("samples", n), ("limit", args.limit))
           if v is not None and v < 1]
    bad += [f"--show must be >= 0 (got {args.show})"] if args.show < 0 else []
    bad += [f"--k {k} must be between 1 and --samples ({n})" for k in ks if not 1 <= k <= n]
    if args.temperature is not None and args.temperature < 0:
        bad.append(f"--temperature must be >= 0 (got {args.temperature})")
    if bad:
        raise MilesError("miles eval: " + "; ".join(bad))
    return n, ks


def run(args: argparse.Namespace) -> int:
    from miles import MilesError
    from miles.cli import load
    from miles.loop import Loop
    from miles.protocols import ExtractsAnswers

    n, ks = _check(args)
    # a run folder's own config.yaml may come from anyone: its plugins: are imported only on request
    trusted = args.trust_run_plugins or not runfolder.is_run_config(args.config)
    loop = Loop(*load(args.config, args.overrides, args.plugin or [], trust_listed=trusted))
    found = runfolder.latest(loop.cfg.run.out_dir)
    if found is None and not args.untrained:  # an untrained model's figures must not pass for the run's
        raise MilesError(f"miles eval: {loop.cfg.run.out_dir} holds no intact checkpoint (missing, empty or "
                         f"not a run folder); train first (miles train), point run.out_dir at a run folder, "
                         f"or pass --untrained to evaluate the initial model")
    loop.build()
    loop.new_trainer(found)
    loop.sync()
    service, env = loop.rollouts, loop.rollouts.env
    tasks = list(env.tasks("eval"))[:args.limit]
    params = loop.eval_params
    if args.samples is not None or n > 1:
        temperature = loop.params.temperature if args.temperature is None else args.temperature
        if temperature <= 0 and n > 1:
            raise MilesError(f"miles eval: --samples {n} at temperature 0 gives {n} equal answers; pass "
                             f"--temperature > 0 or set rollout.temperature")
        params = replace(loop.params, temperature=temperature, max_new_tokens=loop.eval_params.max_new_tokens,
                         seed=loop.cfg.run.seed)
    with loop.mode.lock_engines():
        t0 = time.perf_counter()
        groups = service.run(tasks, n, params)
        seconds = time.perf_counter() - t0
    samples = [s for g in groups for s in g.samples]
    generated = sum(sum(s.loss_mask) for s in samples)  # the model's tokens (not a tool's output)
    rewards = [s.reward for s in samples]
    answer = env.answer if isinstance(env, ExtractsAnswers) else (lambda s: s.response.strip() or None)
    per_prompt = [([answer(s) for s in g.samples], [s.reward >= 1.0 for s in g.samples]) for g in groups]
    extra = service.metrics([g.samples[0] for g in groups])  # the env's and the rollout's own, as in training
    out: dict[str, Any] = {"step": found[1]["step"] if found else None, "prompts": len(groups), "samples": n,
                           "temperature": params.temperature,
                           "eval_accuracy": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
                           "eval_reward_mean": sum(rewards) / max(len(rewards), 1),
                           **{f"eval_{k}": v for k, v in extra.items()}, **summarize(per_prompt, ks),
                           "rollout_seconds": seconds, "generated_tokens_per_s": generated / max(seconds, 1e-9)}
    for i, g in enumerate(groups[:args.show]):
        print(_render(g, i + 1, min(args.show, len(groups)), [a for a in per_prompt[i][0]]), flush=True)
    print(json.dumps(out))
    return 0


def _render(group: Any, i: int, total: int, answers: list) -> str:
    task = group.task
    prompt = task.prompt if isinstance(task.prompt, str) else "\n".join(
        f"[{m.get('role')}] {m.get('content')}" for m in task.prompt)
    lines = [f"--- prompt {i}/{total} ({task.id}), label: {task.label!r}", prompt]
    for j, (s, a) in enumerate(zip(group.samples, answers), 1):
        lines.append(f"response {j}: reward {s.reward:g}, answer {a!r}, {s.status.value}")
        lines.append("  " + s.response.replace("\n", "\n  "))
    return "\n".join(lines)
