"""Training throughput of the megatron trainer against the fsdp2 trainer on the same model, batch
and sequence lengths, with each side's model FLOP utilisation.

Both train a random Qwen2-0.5B-shaped model (bf16 compute, fp32 master weights: fsdp2 through
FSDP2's mixed precision on one rank, megatron through a bf16 copy of its model) on one batch of ``--samples`` rows
of ``--seq`` tokens (``--prompt`` of them prompt), in micro-batches of ``--micro`` rows, with a
policy-gradient loss over the response tokens. After one warm-up step, ``--steps`` optimizer
steps are timed (CUDA synchronised); tokens/s counts every token of every row.

MFU = achieved FLOP/s over the GPU's dense bf16 peak (``--peak-tflops``, 989 for an H200), with
training FLOPs per token = 6 * (matmul weights, LM head included) + 6 * layers * hidden * seq
(causal attention scores and values, forward and backward).

    python benchmarks/trainer_megatron_vs_fsdp2.py --device cuda [--samples 512] [--seq 1024]
        [--micro 16] [--steps 3] [--compile]
    python benchmarks/trainer_megatron_vs_fsdp2.py --shape qwen2-1.5b --precisions bf16 fp8 mxfp8

The last line reads ``trainer megatron/fsdp2 tokens/s ratio R (megatron T tok/s MFU M%, fsdp2 ...)``.
"""
from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

QWEN2_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936}
# Qwen2.5-1.5B's decoder (random init, 32k vocabulary): the dense shape of the FP8 training figure
QWEN2_15B = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 32000}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256}


class Spec:
    """A random Qwen2 of the given shape (tied embeddings), the same weights for both trainers."""

    def __init__(self, shape: dict[str, int], seq: int):
        self.kw = {**shape, "max_position_embeddings": seq, "tie_word_embeddings": True}

    def build_tokenizer(self, default: Any = None) -> Any:
        return default

    def build_model(self, tokenizer: Any) -> torch.nn.Module:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        return Qwen2ForCausalLM(Qwen2Config(**self.kw))


def make_batch(samples: int, seq: int, prompt: int, vocab: int) -> Any:
    from miles import Batch, Sample, Task

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(samples):
        ids = torch.randint(1, vocab, (seq,), generator=g).tolist()
        resp = ids[prompt:]
        rows.append(Sample(task=Task(prompt="x"), prompt_ids=ids[:prompt], response_ids=resp,
                           loss_mask=[1] * len(resp), logprobs=[0.0] * len(resp), reward=float(i % 2)))
    return Batch.from_samples(rows, pad_id=0, advantages=[1.0 if i % 2 else -1.0 for i in range(samples)])


def loss_fn(mb: Any, lp: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    adv = mb.advantages.to(lp.device)
    return -((lp * adv * mb.loss_mask.to(lp.device)).sum() / mb.global_tokens), {}


def train_flops_per_token(shape: dict[str, int], seq: int) -> float:
    H, L, F = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    d = H // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    per_layer = H * H * 2 + 2 * H * kv + 3 * H * F  # q, o, k, v, gate, up, down
    matmul = L * per_layer + shape["vocab_size"] * H
    return 6 * matmul + 6 * L * H * seq


def run(name: str, trainer: Any, batch: Any, steps: int, device: str) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    trainer.train_step(batch, loss_fn)  # warm-up: allocator, kernels, optimizer state
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        m = trainer.train_step(batch, loss_fn)
    sync()
    sec = (time.perf_counter() - t) / steps
    print(f"  {name}: {sec:.3f} s/step  loss {m['loss']:.4f}  grad_norm {m['grad_norm']:.3f}")
    return sec


def make(kind: str, spec: Spec, args: argparse.Namespace, precision: str = "bf16") -> Any:
    if kind == "megatron":
        from miles_plugin_megatron.config import MegatronConfig
        from miles_plugin_megatron.trainer import MegatronTrainer

        cfg = MegatronConfig(device=args.device, precision="bf16", micro_batch_size=args.micro, lr=1e-5,
                             compile=args.compile)
        return MegatronTrainer(cfg, spec=spec, tokenizer=None, total_steps=10)
    from miles_plugin_fsdp2.config import FSDP2Config
    from miles_plugin_fsdp2.trainer import FSDP2Trainer

    cfg = FSDP2Config(device=args.device, shard=args.device.startswith("cuda"), mixed_precision="bf16",
                      micro_batch_size=args.micro, lr=1e-5, compile=args.compile, precision=precision)
    return FSDP2Trainer(cfg, spec=spec, tokenizer=None, total_steps=10)


SHAPES = {"qwen2-0.5b": QWEN2_05B, "qwen2-1.5b": QWEN2_15B, "tiny": TINY}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    ap.add_argument("--precisions", nargs="+", choices=["bf16", "fp8", "mxfp8"], default=None,
                    help="instead of megatron against fsdp2: fsdp2 at each trainer.precision, ratios to the first")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    ap.add_argument("--only", choices=["megatron", "fsdp2"], default=None)
    ap.add_argument("--compile", action="store_true", help="both with trainer.compile (compiled decoder layers)")
    ap.add_argument("--quick", action="store_true", help="tiny shape, 4 rows of 32 tokens, 1 step; without a GPU "
                    "fsdp2 on the CPU only (megatron-core's forward needs CUDA) (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.shape, args.samples, args.seq, args.prompt, args.micro, args.steps = "tiny", 4, 32, 8, 2, 1
        if not torch.cuda.is_available():
            args.device, args.only = "cpu", "fsdp2"
            torch.set_num_threads(1)  # tiny ops gain nothing from a second thread, which spins when cores are busy
    shape = SHAPES[args.shape]
    spec, batch = Spec(shape, args.seq), make_batch(args.samples, args.seq, args.prompt, shape["vocab_size"])
    tokens = args.samples * args.seq
    flops = train_flops_per_token(shape, args.seq)
    print(f"{args.shape}: {args.samples} rows x {args.seq} tokens, micro-batch {args.micro}, "
          f"{flops / 1e9:.2f} GFLOP/token (training), peak {args.peak_tflops:.0f} TFLOP/s")
    out = {}
    runs = [(f"fsdp2 {p}", "fsdp2", p) for p in args.precisions] if args.precisions else \
        [(k, k, "bf16") for k in ("megatron", "fsdp2") if args.only in (None, k)]
    for name, kind, precision in runs:
        trainer = make(kind, spec, args, precision)
        sec = run(name, trainer, batch, args.steps, args.device)
        out[name] = (tokens / sec, tokens * flops / sec / (args.peak_tflops * 1e12))
        del trainer
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    parts = ", ".join(f"{k} {t:,.0f} tok/s MFU {100 * m:.1f}%" for k, (t, m) in out.items())
    if args.precisions:
        base = out[runs[0][0]][0]
        print("trainer precision tokens/s ratios " + ", ".join(f"{k} {t / base:.2f}x" for k, (t, _) in out.items())
              + f" ({parts})")
    elif len(out) == 2:
        print(f"trainer megatron/fsdp2 tokens/s ratio {out['megatron'][0] / out['fsdp2'][0]:.2f} ({parts})")
    else:
        print(f"trainer tokens/s ({parts})")


if __name__ == "__main__":
    main()
