"""The supervised warm start (``run.warm_start``): SFT on the env's demonstrations before RL, run
until eval accuracy plateaus. It drives the run's loop through its public methods only
(``miles.hookspecs.miles_warm_start``); ``warm_start.jsonl`` holds one row per evaluation."""
from __future__ import annotations

import os
import random
import time
from typing import Any

import miles.runfolder as runfolder
from miles.config import registered, validate_settings
from miles.errors import ConfigError
from miles.protocols import RunContext

from .config import WarmStartConfig
from .demos import demo_samples, demonstrations


def settings(raw: dict[str, Any], problems: list[str]) -> WarmStartConfig | None:
    """``run.warm_start`` (the kernel keeps it as given) validated by this plugin's schema."""
    return validate_settings(WarmStartConfig, "run.warm_start", raw, problems)


def trainer_settings(config: Any, pm: Any, ws: WarmStartConfig, problems: list[str]) -> Any:
    """The trainer section with ``run.warm_start.trainer`` applied over it, validated by the
    trainer's own schema; problems are named ``run.warm_start.trainer.<key>``."""
    raw = config.raw.get("trainer") if isinstance(config.raw.get("trainer"), dict) else {}
    merged = {**{k: v for k, v in raw.items() if k != "name"}, **ws.trainer}
    schema = pm.registry("trainers")[config.name("trainer")].config
    return validate_settings(schema, "run.warm_start.trainer", merged, problems)


def check(raw: dict[str, Any], pm: Any) -> list[str]:
    """Every problem of ``run.warm_start`` (as given), each naming its ``run.warm_start.<key>``."""
    problems: list[str] = []
    ws = settings(raw, problems)
    algorithm = ws.algorithm if ws is not None else raw.get("algorithm", "sft")
    if isinstance(algorithm, str):  # reported with the other keys' problems, all at once
        registered(pm, "algorithms", "run.warm_start.algorithm", algorithm, problems)
    return problems


def warm_start(run: RunContext, raw: dict[str, Any]) -> bool:
    """Train the loop's trainer (one of the warm start's own: its LR schedule spans ``max_steps``)
    on demonstrations; every ``eval_every`` steps push the weights and evaluate; stop after
    ``patience`` evaluations without a gain of ``min_delta`` (not before ``min_steps``)."""
    cfg, env, tok = run.cfg, run.components.env, run.components.tokenizer
    problems: list[str] = []
    ws = settings(raw, problems)
    if ws is None:  # miles_validate_config reported it before the run began
        raise ConfigError(problems, source="run.warm_start")
    demos = demonstrations(env, "run.warm_start", "remove run.warm_start or pick an env that provides them")
    rng = random.Random(cfg.run.seed)
    algo = run.pm.create("algorithms", ws.algorithm, None)
    run.new_trainer(settings=trainer_settings(cfg, run.pm, ws, []), algorithm=algo, total_steps=ws.max_steps)
    log = None
    if run.main:  # a fresh run (no checkpoint): rows of an earlier, interrupted attempt are redone
        path = os.path.join(cfg.run.out_dir, "warm_start.jsonl")
        runfolder.truncate_metrics(path, None)
        log = runfolder.MetricsLog(out_dir=cfg.run.out_dir, filename="warm_start.jsonl")
    best, stale, skipped, t0 = -1.0, 0, 0, time.perf_counter()
    try:
        for step in range(1, ws.max_steps + 1):
            if run.stopping():
                raise KeyboardInterrupt
            run.console("", progress=("warm start", step - 1, ws.max_steps))
            samples = demo_samples(demos, ws.batch_size, rng, tokenizer=tok, env=env, rollout=run.rollout_component,
                                   version=run.version, rollout_name=cfg.rollout.name)
            # one step per batch: rollout.minibatches (PPO-style) must not change the warm start
            m = run.update(samples, [0.0] * ws.batch_size, algo, minibatches=1)
            skipped += bool(m.get("nonfinite_skipped"))
            m["nonfinite_steps"] = skipped
            if step % ws.eval_every and step != ws.max_steps:
                continue
            run.publish()
            m.update(run.evaluate(), seconds=time.perf_counter() - t0)
            if log is not None:
                log.log(step, m)
                run.console(f"warm start step {step}: eval_acc {m['eval_accuracy']:.3f}  "
                            f"loss {m.get('sft_loss', float('nan')):.4f}")
            if m["eval_accuracy"] > best + ws.min_delta:
                best, stale = m["eval_accuracy"], 0
            else:
                stale += 1
                if stale >= ws.patience and step >= ws.min_steps:
                    break
        run.console("", progress=("warm start", ws.max_steps, ws.max_steps))  # done (or stopped early)
    finally:
        if log is not None:
            log.close()
    return True
