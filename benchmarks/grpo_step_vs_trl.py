#!/usr/bin/env python
"""One miles GRPO step (rollout + train + weight sync) against one TRL ``GRPOTrainer`` step.

Identical work (CPU, fp32, 2 torch threads): same Qwen2 config and initial weights, the arith env's
char tokenizer and prompts ("07+45="), exact-match reward, no KL, one on-policy optimizer step per
generation of prompts x samples completions (no old/ref log-probs), every group trained.
Shape B generates exactly 32 tokens: TRL via ``generation_kwargs={"min_new_tokens": 32}`` (HF masks
EOS); miles' engine stops on ``params.stop_token_ids | {engine.eos_id}``, so the SamplingParams get
``stop_token_ids=[]`` and the engine instance ``eos_id = None`` after build. The tokenizer stays
untouched (engine pad id fixed at construction; the trainer pads with ``tokenizer.pad_token_id``);
EOS can still be sampled mid-response in miles; it just does not stop it. Mean response lengths
are printed so the equal work can be checked. The sides alternate step by step (a miles step runs
from TRL's on_step_end, outside TRL's clock) so load changes hit both alike, and the CPU share of
other processes is printed: 2-thread OpenMP ops stall badly when another process shares the cores.

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
    "B": dict(label="larger shape", prompts=16, samples=8, new_tokens=32, no_eos=True, warmup=2, steps=10,
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
    if shape["no_eos"]:  # see the module docstring: EOS does not stop a response here
        loop.params = dataclasses.replace(loop.params, stop_token_ids=[])
        p.engine.eos_id = None
    loop.new_trainer()
    loop.sync()
    return loop


def miles_step(loop, step: int) -> dict:
    m = loop.rl_step(step)
    known = m["rollout_seconds"] + m["train_seconds"] + m["weight_sync_seconds"]
    return {"generation": m["rollout_seconds"], "logprobs": 0.0, "train": m["train_seconds"],
            "sync": m["weight_sync_seconds"], "other": m["step_seconds"] - known,
            "step": m["step_seconds"], "length": m["response_length_mean"], "reward": m["reward_mean"]}


def timed_trainer(GRPOTrainer, TrainerCallback):
    """A GRPOTrainer subclass that clocks its phases, and the callback that closes each step."""
    import torch

    class TimedGRPOTrainer(GRPOTrainer):  # self.clock is reset by StepClock.on_step_begin
        def _clocked(self, key, fn, *a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.clock[key] = self.clock.get(key, 0.0) + time.perf_counter() - t0
            return out

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
        def __init__(self, after_step):
            self.trainer, self.after_step = None, after_step
            self.steps, self.lengths, self.rewards = [], [], []

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
            self.after_step()  # the interleaved miles step, after TRL's step was clocked

    return TimedGRPOTrainer, StepClock


def run_both(loop, init_state: dict, shape: dict, out_dir: str) -> tuple[list[dict], list[dict]]:
    """TRL's training loop with one miles step run after each TRL step, so that both sides see
    the same machine load; returns the (miles, TRL) rows after the warm-up steps."""
    import warnings

    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # gradient_checkpointing renames
    tok = loop.components.tokenizer
    model = loop.components.spec.build_model(tok)  # same config as miles ...
    model.load_state_dict(init_state)  # ... and the same initial weights
    data = Dataset.from_list([{"prompt": t.prompt, "label": t.label} for t in loop.components.env.tasks("train")])
    Trainer, StepClock = timed_trainer(GRPOTrainer, transformers.TrainerCallback)
    miles: list[dict] = []
    clock = StepClock(lambda: miles.append(miles_step(loop, len(miles) + 1)))

    def exact_match(prompts, completions, completion_ids, label, **_):
        rewards = [1.0 if c.strip() == want else 0.0 for c, want in zip(completions, label)]
        clock.lengths.append(sum(map(len, completion_ids)) / len(completion_ids))
        clock.rewards.append(sum(rewards) / len(rewards))
        return rewards

    n, algo = shape["new_tokens"], loop.components.algorithm.cfg
    args = GRPOConfig(
        output_dir=out_dir, use_vllm=False, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=shape["prompts"] * shape["samples"],
        num_generations=shape["samples"], steps_per_generation=1, num_iterations=1,
        gradient_accumulation_steps=1, max_completion_length=n, beta=0.0, temperature=1.0,
        epsilon=algo.clip_low, epsilon_high=algo.clip_high_value,
        learning_rate=loop.cfg.settings("trainer").lr, lr_scheduler_type="constant", max_grad_norm=1.0,
        max_steps=shape["warmup"] + shape["steps"], logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, seed=loop.cfg.run.seed,
        generation_kwargs={"min_new_tokens": n} if shape["no_eos"] else None)
    trainer = Trainer(model=model, reward_funcs=exact_match, args=args, train_dataset=data,
                      processing_class=tok, callbacks=[clock])
    trainer.remove_callback(transformers.PrinterCallback)  # no per-step log dicts on stdout
    clock.trainer = trainer
    torch.set_num_threads(THREADS)  # in case accelerate changed it
    trainer.train()
    return miles[shape["warmup"]:], clock.steps[shape["warmup"]:]


def cpu_times() -> tuple[float, float, float] | None:
    """(busy, total) CPU seconds of the whole machine (/proc/stat) and this process's CPU time."""
    if not os.path.exists("/proc/stat"):
        return None
    with open("/proc/stat") as f:
        v = [int(x) / os.sysconf("SC_CLK_TCK") for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v), time.process_time()


def others_share(t0) -> float:
    """Share of all CPUs that other processes used since ``t0 = cpu_times()``."""
    t1 = cpu_times()
    if not (t0 and t1):
        return 0.0
    busy, total, own = (y - x for x, y in zip(t0, t1))
    return max(0.0, busy - own) / max(total, 1e-9)


LEGEND = """\
  miles: generation = rollout_seconds (prompt encode, engine.generate, decode, reward); backward+
    optimizer = train_seconds (advantages, padding, fwd, bwd, clip, AdamW); sync = weight_sync_seconds.
  TRL: generation = _generate_single_turn (padding, model.generate); log-probs = no-grad
    _get_per_token_logps_and_entropies; backward+optimizer = end of _prepare_inputs .. on_optimizer_step
    (loss fwd incl. entropy, bwd, clip, fused AdamW); other: tokenize, decode, reward, advantages.
  No side computes old/ref log-probs here (no KL, one optimizer step per generation)."""


def report(name: str, shape: dict, model, miles: list[dict], trl: list[dict], others: float) -> float:
    c, params = model.config, sum(p.numel() for p in model.parameters())
    print(f"\nShape {name} ({shape['label']}): Qwen2 hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads} heads/{c.num_key_value_heads} KV, FFN {c.intermediate_size}, "
          f"vocab {c.vocab_size}, {params / 1e6:.2f}M params; {shape['prompts']} prompts x "
          f"{shape['samples']} samples x {shape['new_tokens']} new tokens; median of {len(miles)} steps "
          f"after {shape['warmup']} warm-up (each row its own median)")
    med = {k: [statistics.median(r[k] for r in rows) for rows in (miles, trl)] for k in miles[0]}
    print(f"  {'':<22}{'miles':>10}{'TRL':>10}")
    for label, key in (("generation", "generation"), ("log-probs (old/ref)", "logprobs"),
                       ("backward+optimizer", "train"), ("weight sync", "sync"), ("other", "other"),
                       ("step", "step")):
        print(f"  {label:<22}{med[key][0]:>9.3f}s{med[key][1]:>9.3f}s")
    for label, key in (("mean response length", "length"), ("mean reward", "reward")):
        print(f"  {label:<22}{statistics.mean(r[key] for r in miles):>10.2f}"
              f"{statistics.mean(r[key] for r in trl):>10.2f}")
    ratio = med["step"][1] / med["step"][0]
    verdict = "PASS" if ratio >= shape["target"] else "FAIL"
    print(f"  TRL step / miles step = {ratio:.2f}x (target {shape['target']:g}x): {verdict}")
    if others > 0.05:
        print(f"  WARNING: other processes used {others:.0%} of the CPUs during this shape; 2-thread "
              f"OpenMP ops stall when cores are shared, so these timings are inflated and noisy")
    return ratio


def bench_shape(name: str, shape: dict) -> float:
    tmp = tempfile.mkdtemp(prefix=f"grpo_bench_{name}_")
    try:
        loop = build_miles(shape, os.path.join(tmp, "miles"))
        model = loop.components.trainer.model
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        print(f"[{name}] {shape['warmup']} warm-up + {shape['steps']} measured steps, TRL and miles "
              f"alternating ...", flush=True)
        t0 = cpu_times()
        miles, trl = run_both(loop, init, shape, os.path.join(tmp, "trl"))
        return report(name, shape, model, miles, trl, others_share(t0))
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
    t0 = cpu_times()
    time.sleep(1.0)
    print(f"torch {torch.__version__}, trl {trl.__version__}, {THREADS} threads, fp32, CPU; "
          f"{os.cpu_count()} CPUs, {others_share(t0):.0%} used by other processes before start")
    shapes = [{**SHAPES[n], **(dict(warmup=1, steps=2) if args.quick else {})} for n in names]
    ratios = [bench_shape(n, s) for n, s in zip(names, shapes)]
    print(f"\n{LEGEND}")
    summary = ", ".join(f"{s['label']} {r:.2f}x (target {s['target']:g}x)" for s, r in zip(shapes, ratios))
    print(f"grpo_step_vs_trl: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
