#!/usr/bin/env python
"""One miles GRPO step (rollout + train + weight sync) against one TRL ``GRPOTrainer`` step.

Identical work on both sides (CPU, fp32, 2 torch threads): the same Qwen2 config and initial
weights, the arith env's char tokenizer and prompts ("07+45="), an exact-match reward, no KL term,
one on-policy optimizer step per generation of prompts x samples completions (so no old/ref
log-probs anywhere) and every group trained (miles filter_zero_variance=false).

Shape B must generate exactly 32 tokens, so EOS may not end a completion on either side. TRL:
``generation_kwargs={"min_new_tokens": 32}`` (HF masks EOS until 32 tokens exist). miles: the
engine stops on ``params.stop_token_ids | {engine.eos_id}``, so the run's SamplingParams get
``stop_token_ids=[]`` and the engine instance ``eos_id = None`` after build; the tokenizer is
untouched (the engine's pad id is fixed at construction, the trainer pads with
``tokenizer.pad_token_id``). EOS can still be sampled mid-response in miles, it just no longer
stops it. The mean response lengths are printed so the equal work can be checked.

Usage: python benchmarks/grpo_step_vs_trl.py [--quick] [--shapes A,B]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "quickstart.yaml")
THREADS = 2
SHAPES = {
    "A": dict(label="quickstart shape", prompts=64, samples=4, new_tokens=4, model={}, no_eos=False,
              warmup=2, steps=8, target=2.0),
    "B": dict(label="larger shape", prompts=16, samples=8, new_tokens=32, no_eos=True, warmup=2, steps=5,
              target=1.5, model=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                                     num_attention_heads=8, num_key_value_heads=4,
                                     max_position_embeddings=64)),
}


def build_miles(shape: dict, out_dir: str):
    """A miles Loop ready for ``rl_step`` (trainer built, weights synced to the engine)."""
    from miles.config import apply_overrides, read_yaml, resolve
    from miles.loop import Loop
    from miles.plugins import make_plugin_manager

    overrides = ["run.warm_start=null", f"run.out_dir={out_dir}", f"run.threads={THREADS}",
                 f"rollout.batch_size={shape['prompts']}", f"rollout.n={shape['samples']}",
                 f"rollout.max_new_tokens={shape['new_tokens']}", "algorithm.filter_zero_variance=false",
                 "trainer.warmup_steps=0"]  # constant LR, as TRL's lr_scheduler_type="constant" below
    overrides += [f"model.config.{k}={v}" for k, v in shape["model"].items()]
    pm = make_plugin_manager()
    cfg = resolve(pm, apply_overrides(read_yaml(RECIPE), overrides))
    loop = Loop(pm, cfg)
    p = loop.build()
    if shape["no_eos"]:  # see the module docstring: EOS no longer stops a response
        loop.params = dataclasses.replace(loop.params, stop_token_ids=[])
        p.engine.eos_id = None
    p.trainer = loop.make_trainer(cfg.settings("trainer"), p.algorithm)
    loop.sync()
    return loop


def run_miles(loop, warmup: int, steps: int) -> list[dict]:
    out = []
    for step in range(1, warmup + steps + 1):
        m = loop.rl_step(step)
        known = m["rollout_seconds"] + m["train_seconds"] + m["weight_sync_seconds"]
        out.append({"generation": m["rollout_seconds"], "logprobs": 0.0, "train": m["train_seconds"],
                    "sync": m["weight_sync_seconds"], "other": m["step_seconds"] - known,
                    "step": m["step_seconds"], "length": m["response_length_mean"],
                    "reward": m["reward_mean"]})
    return out[warmup:]


def timed_trainer(GRPOTrainer, TrainerCallback):
    """A GRPOTrainer subclass that clocks its phases, and the callback that closes each step."""
    import torch

    class TimedGRPOTrainer(GRPOTrainer):
        clock: dict = {}

        def _clocked(self, key, fn, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.clock[key] = self.clock.get(key, 0.0) + time.perf_counter() - t0

        def _generate_single_turn(self, *a, **kw):  # prompt padding + model.generate
            return self._clocked("generation", super()._generate_single_turn, *a, **kw)

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            if torch.is_grad_enabled():  # the training forward: counted in "train"
                return super()._get_per_token_logps_and_entropies(*a, **kw)
            return self._clocked("logprobs", super()._get_per_token_logps_and_entropies, *a, **kw)

        def _prepare_inputs(self, *a, **kw):  # generation, rewards, advantages, (old/ref log-probs)
            out = super()._prepare_inputs(*a, **kw)
            self.clock["train_start"] = time.perf_counter()
            return out

    class StepClock(TrainerCallback):
        def __init__(self):
            self.trainer, self.steps, self.lengths, self.rewards = None, [], [], []

        def on_step_begin(self, args, state, control, **kw):
            self.trainer.clock = {}
            self.t0 = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kw):  # loss fwd + backward + clip + step
            c = self.trainer.clock
            c["train"] = time.perf_counter() - c.pop("train_start")

        def on_step_end(self, args, state, control, **kw):
            c, total = self.trainer.clock, time.perf_counter() - self.t0
            row = {k: c.get(k, 0.0) for k in ("generation", "logprobs", "train")}
            row.update(sync=0.0, other=total - sum(row.values()), step=total,
                       length=self.lengths[-1], reward=self.rewards[-1])
            self.steps.append(row)

    return TimedGRPOTrainer, StepClock


def run_trl(loop, init_state: dict, shape: dict, warmup: int, steps: int, out_dir: str) -> list[dict]:
    import warnings

    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # gradient_checkpointing renames
    tok = loop.p.tokenizer
    model = loop.p.spec.build_model(tok)  # same config as miles ...
    model.load_state_dict(init_state)  # ... and the same initial weights
    data = Dataset.from_list([{"prompt": t.prompt, "label": t.label} for t in loop.train_tasks])
    Trainer, StepClock = timed_trainer(GRPOTrainer, transformers.TrainerCallback)
    clock = StepClock()

    def exact_match(prompts, completions, completion_ids, label, **_):
        rewards = [1.0 if c.strip() == want else 0.0 for c, want in zip(completions, label)]
        clock.lengths.append(sum(map(len, completion_ids)) / len(completion_ids))
        clock.rewards.append(sum(rewards) / len(rewards))
        return rewards

    n, algo = shape["new_tokens"], loop.p.algorithm.cfg
    args = GRPOConfig(
        output_dir=out_dir, use_vllm=False, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=shape["prompts"] * shape["samples"],
        num_generations=shape["samples"], steps_per_generation=1, num_iterations=1,
        gradient_accumulation_steps=1, max_completion_length=n, beta=0.0, temperature=1.0,
        epsilon=algo.clip_low, epsilon_high=algo.clip_high_value,
        learning_rate=loop.cfg.settings("trainer").lr, lr_scheduler_type="constant", max_grad_norm=1.0,
        max_steps=warmup + steps, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_pin_memory=False, seed=loop.cfg.run.seed,
        generation_kwargs={"min_new_tokens": n} if shape["no_eos"] else None)
    trainer = Trainer(model=model, reward_funcs=exact_match, args=args, train_dataset=data,
                      processing_class=tok, callbacks=[clock])
    trainer.remove_callback(transformers.PrinterCallback)  # no per-step log dicts on stdout
    clock.trainer = trainer
    torch.set_num_threads(THREADS)  # in case accelerate changed it
    trainer.train()
    return clock.steps[warmup:]


def others_busy(seconds: float = 1.0) -> float:
    """Share of all CPUs busy with other processes while this one sleeps (Linux /proc/stat)."""
    def sample():  # (idle + iowait, total) jiffies
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)
    if not os.path.exists("/proc/stat"):
        return 0.0
    (i0, t0), _, (i1, t1) = sample(), time.sleep(seconds), sample()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


LEGEND = """\
  miles: generation = rollout_seconds (prompt encode, engine.generate, decode, reward);
    backward+optimizer = train_seconds (advantages, padding, forward, backward, clip, AdamW);
    sync = weight_sync_seconds; no log-probs are computed (kl_coef=0, one mini-batch).
  TRL: generation = _generate_single_turn (prompt padding, model.generate); log-probs = no-grad
    _get_per_token_logps_and_entropies (none: beta=0, steps_per_generation=num_iterations=1);
    backward+optimizer = end of _prepare_inputs .. on_optimizer_step (loss forward incl. entropy,
    backward, clip, fused AdamW); one model, so no sync.
  other = step - the rest (TRL: tokenize, decode, reward, advantages; logging is not counted)."""


def report(name: str, shape: dict, model, miles: list[dict], trl: list[dict]) -> float:
    c, params = model.config, sum(p.numel() for p in model.parameters())
    print(f"\nShape {name} ({shape['label']}): Qwen2 hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads} heads/{c.num_key_value_heads} KV, FFN {c.intermediate_size}, "
          f"vocab {c.vocab_size}, {params / 1e6:.2f}M params; {shape['prompts']} prompts x "
          f"{shape['samples']} samples x {shape['new_tokens']} new tokens; median of {len(miles)} steps "
          f"after {shape['warmup']} warm-up (each row its own median)")
    print(f"  {'':<22}{'miles':>10}{'TRL':>10}")
    for label, key in (("generation", "generation"), ("log-probs (old/ref)", "logprobs"),
                       ("backward+optimizer", "train"), ("weight sync", "sync"), ("other", "other"),
                       ("step", "step")):
        print(f"  {label:<22}{median(miles, key):>9.3f}s{median(trl, key):>9.3f}s")
    for label, key in (("mean response length", "length"), ("mean reward", "reward")):
        print(f"  {label:<22}{statistics.mean(r[key] for r in miles):>10.2f}"
              f"{statistics.mean(r[key] for r in trl):>10.2f}")
    ratio = median(trl, "step") / median(miles, "step")
    verdict = "PASS" if ratio >= shape["target"] else "FAIL"
    print(f"  TRL step / miles step = {ratio:.2f}x (target {shape['target']:g}x): {verdict}")
    return ratio


def bench_shape(name: str, shape: dict) -> float:
    tmp = tempfile.mkdtemp(prefix=f"grpo_bench_{name}_")
    try:
        loop = build_miles(shape, os.path.join(tmp, "miles"))
        model = loop.p.trainer.model
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        plan = f"{shape['warmup']} warm-up + {shape['steps']} measured steps"
        print(f"[{name}] miles: {plan} ...", flush=True)
        miles = run_miles(loop, shape["warmup"], shape["steps"])
        print(f"[{name}] TRL:   {plan} ...", flush=True)
        trl = run_trl(loop, init, shape, shape["warmup"], shape["steps"], os.path.join(tmp, "trl"))
        return report(name, shape, model, miles, trl)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 2 measured steps (smoke run)")
    ap.add_argument("--shapes", default="A,B", help="comma-separated subset of A,B")
    args = ap.parse_args()
    try:
        import trl  # noqa: F401  (installed for this benchmark only)
    except ImportError:
        print("grpo_step_vs_trl: TRL is not importable; pip install trl", file=sys.stderr)
        return 1
    import torch

    torch.set_num_threads(THREADS)
    names = [s.strip().upper() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in names if s not in SHAPES]
    if bad or not names:
        ap.error(f"--shapes: unknown {bad or 'empty'}; choose from {','.join(SHAPES)}")
    busy = others_busy()
    print(f"torch {torch.__version__}, trl {trl.__version__}, {THREADS} threads, fp32, CPU; "
          f"{os.cpu_count()} CPUs, {busy:.0%} busy with other processes before start")
    if busy > 0.2:
        print("WARNING: other processes are using the CPUs; with 2 OpenMP threads competing for "
              "cores, every op can stall and the timings below are slow and noisy")
    shapes = [{**SHAPES[n], **(dict(warmup=1, steps=2) if args.quick else {})} for n in names]
    ratios = [bench_shape(n, s) for n, s in zip(names, shapes)]
    print(f"\n{LEGEND}")
    summary = ", ".join(f"{s['label']} {r:.1f}x (target {s['target']:g}x)" for s, r in zip(shapes, ratios))
    print(f"grpo_step_vs_trl: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
