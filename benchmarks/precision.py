"""Rollout/training alignment of every supported low-precision pair.

For each pair (training / rollout): bf16/bf16, bf16/fp8, fp8/fp8, int4 QAT/int4, mxfp8/mxfp8, the
fsdp2 trainer is built with that ``trainer.precision`` / ``trainer.qat``, the torch engine with that
``engine.weights_dtype``, and the engine receives the trainer's weights as a run syncs them (packed
where the trainer computes in a low-precision format). The engine samples; the trainer scores the
same samples. Printed per pair: mean and max |logp_train - logp_rollout| over response tokens, the
KL between the two policies on the rollout's samples (k3 = exp(d) - 1 - d with d = logp_train -
logp_rollout: unbiased for KL(rollout || train) and non-negative), the engine's generated
tokens/s and the trainer's training tokens/s (prompt and response tokens through one optimizer
step). The model is randomly initialised (same seed for every pair).

On CPU "bf16" is the model's own dtype, float32, on both sides (the trainer's master weights and a
float32 engine); fp8 GEMMs are emulated on the trainer's side and run as ``torch._scaled_mm`` in the
engine; mxfp8 is emulated on both. ``--device cuda``: the engine in bfloat16 and FP8 GEMMs on
``torch._scaled_mm`` (compute capability >= 8.9); MXFP8 stays emulated (no MX tensor cores on Hopper).

    python benchmarks/precision.py [--quick] [--device cpu|cuda] [--shape quickstart|0.5b|0.5b-moe]
                                   [--prompts 64] [--n 4] [--new-tokens 8] [--steps 3] [--threads 1]

``--learn``: the same mismatch in training runs instead: ``recipes/quickstart.yaml`` from one warm
start (run once in the recipe's precision and exported), then ``--rl-steps`` GRPO steps each with
bf16 rollout (the reference), FP8 rollout without a correction, and FP8 rollout with IcePop
(``algorithm.icepop``, ``--icepop LOW HIGH``); training stays in the model's dtype (float32 on CPU).
Printed per run: greedy eval accuracy at the start and at every ``--eval-every``, the mean
train/rollout |dlogp| and, where IcePop runs, the share of tokens it masked, its mean weight and the
token ratios' mean / min / max over the run (the warm start keeps ``--seed``; ``--seeds`` repeats
the RL runs over seeds).

    python benchmarks/precision.py --learn [--rl-steps 50] [--eval-every 25] [--warm-steps 600]
                                   [--icepop 0.5 5] [--seed 0] [--seeds 1] [--threads 1] [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from miles import Batch, SamplingParams, Sample, Task

PAIRS = [  # (label, trainer settings, engine.weights_dtype)
    ("bf16 / bf16", {}, "model"),
    ("bf16 / fp8", {}, "fp8"),
    ("fp8 / fp8", {"precision": "fp8"}, "fp8"),
    ("int4 QAT / int4", {"qat": "int4"}, "int4"),
    ("mxfp8 / mxfp8", {"precision": "mxfp8"}, "mxfp8"),
]

QUICKSTART = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
              "tie_word_embeddings": True}
SHAPES = {
    "quickstart": QUICKSTART,
    # Qwen2.5-0.5B's decoder (random init) over a 32k vocabulary
    "0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 64,
             "vocab_size": 32000, "tie_word_embeddings": True},
    # a Qwen3-MoE of about 0.5B: 64 experts of width 128, top-4
    "0.5b-moe": {"model_type": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 512,
                 "moe_intermediate_size": 128, "num_experts": 64, "num_experts_per_tok": 4,
                 "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
                 "max_position_embeddings": 64, "vocab_size": 32000, "norm_topk_prob": True},
}


def prompts(tok, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randint(10, 100, (count, 2), generator=g).tolist()
    return [tok(f"{a}+{b}=")["input_ids"] for a, b in pairs]


def build(args, trainer_settings: dict, weights_dtype: str):
    from miles_plugin_arith.env import char_tokenizer
    from miles_plugin_fsdp2.config import FSDP2Config
    from miles_plugin_fsdp2.trainer import FSDP2Trainer
    from miles_plugin_hf.config import HFModelConfig
    from miles_plugin_hf.spec import HFModelSpec
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    tok = char_tokenizer()
    spec = HFModelSpec(HFModelConfig(config=SHAPES[args.shape]))
    trainer = FSDP2Trainer(FSDP2Config(device=args.device, cpu_workers=1, **trainer_settings), spec=spec,
                           tokenizer=tok, seed=args.seed)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    engine = TorchEngine(TorchEngineConfig(device=args.device, dtype=dtype, weights_dtype=weights_dtype,
                                           impl="hf" if weights_dtype != "model" else "auto"),
                         spec=spec, tokenizer=tok, seed=args.seed)
    # as the run's sync sends them: packed where the trainer computes in a low-precision format
    engine.load_weights(trainer.packed_weights() if trainer.packed_formats else trainer.named_weights(), 1)
    return tok, trainer, engine


def measure(args, label: str, trainer_settings: dict, weights_dtype: str) -> dict:
    tok, trainer, engine = build(args, trainer_settings, weights_dtype)
    ps = prompts(tok, args.prompts, args.seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    engine.generate(ps[:2], params, n=1)  # warm-up
    sync()
    t0 = time.perf_counter()
    outs = engine.generate(ps, params, n=args.n)
    sync()
    gen_s = time.perf_counter() - t0
    samples = [Sample(task=Task(prompt=""), prompt_ids=p, response_ids=c.token_ids, logprobs=c.logprobs)
               for p, cs in zip(ps, outs) for c in cs]
    batch = Batch.from_samples(samples, tok.pad_token_id, advantages=[(i % 3) - 1.0 for i in range(len(samples))])
    m = batch.loss_mask > 0
    d = (trainer.logprobs(batch) - batch.rollout_logprobs)[m].double()
    new_tokens = int(m.sum())

    def loss(b, lp):
        return b.token_mean(-b.advantages * lp), {}

    trainer.train_step(batch, loss)  # warm-up
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(batch, loss)
    sync()
    train_s = (time.perf_counter() - t0) / args.steps
    tokens = int(batch.attention_mask.sum())
    return {"pair": label, "mean": float(d.abs().mean()), "max": float(d.abs().max()),
            "kl": float((torch.exp(d) - 1 - d).mean()), "rollout_tps": new_tokens / gen_s,
            "train_tps": tokens / train_s}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


ROOT = Path(__file__).resolve().parents[1]
LEARN_RUNS = [  # (label, overrides of the RL run); --icepop fills in the band
    ("bf16 / bf16", {}),
    ("bf16 / fp8", {"engine": {"weights_dtype": "fp8"}}),
    ("bf16 / fp8 + IcePop", {"engine": {"weights_dtype": "fp8"}, "algorithm": {"icepop": None}}),
]


def miles(*args: str) -> float:
    """Run ``miles ARGS`` in a subprocess; its wall seconds."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "miles.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"`miles {' '.join(args)}` failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def learn(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "warm_model"
    if not model.is_dir():  # the recipe's supervised warm start, once, in its own precision
        steps = [f"run.warm_start.min_steps={args.warm_steps}", f"run.warm_start.max_steps={args.warm_steps}"]
        s = miles("train", "recipes/quickstart.yaml", f"run.out_dir={work / 'warm'}", "run.steps=0",
                  f"run.threads={args.threads}", f"run.seed={args.seed}", *steps)
        miles("export", str(work / "warm"), "--to", str(model))
        print(f"warm start: {args.warm_steps} supervised steps in {s:.0f} s", flush=True)
    print(f"{'training / rollout':<20} {'seed':>4} {'mean|dlogp|':>11} {'masked':>8} {'weight':>7} "
          f"{'ratio mean/min/max':>22} {'wall s':>7}  eval accuracy (step)")
    final: dict[str, list[float]] = {}
    for seed in range(args.seed, args.seed + args.seeds):
        for label, overrides in LEARN_RUNS:
            r, wall = learn_run(args, model, label, overrides, seed)
            final.setdefault(label, []).append(r["eval"][-1][1])
            curve = " -> ".join(f"{a:.3f}" + (f" ({s})" if s else "") for s, a in r["eval"])
            ratio = (f"{r['ratio_mean']:.4f}/{r['ratio_min']:.3g}/{r['ratio_max']:.3g}"
                     if "ratio_mean" in r else "-")
            masked = f"{r['masked']:.2e}" if "masked" in r else "-"
            weight = f"{r['weight']:.4f}" if "weight" in r else "-"
            print(f"{label:<20} {seed:>4} {r['dlogp']:>11.2e} {masked:>8} {weight:>7} {ratio:>22} {wall:>7.0f}  "
                  f"{curve}", flush=True)
    for label, accs in final.items():
        print(f"final eval accuracy, {label}: mean {sum(accs) / len(accs):.3f} over {len(accs)} seed(s) "
              f"({', '.join(f'{a:.3f}' for a in accs)})")


def learn_run(args, model: Path, label: str, overrides: dict, seed: int) -> tuple[dict, float]:
    """One GRPO run of the quickstart recipe from the warm model: its summary and wall seconds."""
    import shutil

    import yaml

    cfg = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    cfg["model"] = {"name": "hf", "path": str(model)}
    cfg["run"].pop("warm_start")
    out = Path(args.work) / f"{label.replace(' ', '').replace('/', '_').replace('+', '_')}_seed{seed}"
    cfg["run"].update(steps=args.rl_steps, out_dir=str(out), eval_every=args.eval_every,
                      checkpoint_every=args.rl_steps, threads=args.threads, seed=seed)
    for section, values in overrides.items():
        cfg[section].update({k: (list(args.icepop) if k == "icepop" else v) for k, v in values.items()})
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    shutil.rmtree(out, ignore_errors=True)
    wall = miles("train", str(path))
    return learn_summary(out), wall


def learn_summary(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "train_rollout_logprob_abs_diff" in r]

    def mean(key: str) -> float:
        return sum(r[key] for r in steps) / len(steps)

    r = {"eval": [(row["step"], row["eval_accuracy"]) for row in rows if "eval_accuracy" in row],
         "dlogp": mean("train_rollout_logprob_abs_diff")}
    if steps and "icepop_masked_frac" in steps[0]:
        r.update(masked=mean("icepop_masked_frac"), weight=mean("icepop_weight_mean"),
                 ratio_mean=mean("mismatch_ratio_mean"), ratio_min=min(x["mismatch_ratio_min"] for x in steps),
                 ratio_max=max(x["mismatch_ratio_max"] for x in steps))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts x 2, 4 new tokens, 1 timed step (the suite's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="quickstart", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--learn", action="store_true", help="GRPO runs of the quickstart recipe: bf16 rollout, "
                    "fp8 rollout, fp8 rollout with IcePop (see the module doc)")
    ap.add_argument("--rl-steps", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seeds", type=int, default=1, help="--learn: RL runs of seeds seed .. seed+seeds-1")
    ap.add_argument("--warm-steps", type=int, default=600, help="the warm start's supervised steps")
    ap.add_argument("--icepop", type=float, nargs=2, default=[0.5, 5.0], metavar=("LOW", "HIGH"))
    ap.add_argument("--work", default="runs/precision_learn", help="the runs' folder (the warm model is kept)")
    args = ap.parse_args()
    if args.learn:
        return learn(args)
    if args.quick:
        args.prompts, args.n, args.new_tokens, args.steps = 8, 2, 4, 1
    torch.set_num_threads(args.threads)
    print(f"shape {args.shape}, device {args.device}, {args.prompts} prompts x {args.n}, "
          f"{args.new_tokens} new tokens, {args.threads} thread(s)")
    print(f"{'training / rollout':<18} {'mean|dlogp|':>12} {'max|dlogp|':>11} {'KL':>10} "
          f"{'rollout tok/s':>14} {'train tok/s':>12}")
    for label, settings, weights in PAIRS:
        r = measure(args, label, settings, weights)
        print(f"{r['pair']:<18} {r['mean']:>12.2e} {r['max']:>11.2e} {r['kl']:>10.2e} "
              f"{r['rollout_tps']:>14.0f} {r['train_tps']:>12.0f}", flush=True)


if __name__ == "__main__":
    main()
