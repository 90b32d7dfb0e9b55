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
"""
from __future__ import annotations

import argparse
import time

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
    args = ap.parse_args()
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
