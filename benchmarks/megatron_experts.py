#!/usr/bin/env python
"""What the megatron trainer's grouped experts save in a mixture-of-experts training step:
megatron with its routed experts as grouped GEMMs (``miles_plugin_megatron.experts``), megatron
with megatron-core's per-expert loop (``SequentialMLP``, as its local layer spec builds it), and
the fsdp2 trainer, on the same random DeepSeek-V3-shaped model and batch, measured in one run.

Per step: aten operations (a proxy for kernel launches, which bound small steps on a GPU), host
syncs (CPU only: ``miles.testing.syncs``) and the median wall time of ``--steps`` steps after a
warm-up. On CPU megatron-core runs with the plugin's CPU stand-ins.

    python benchmarks/megatron_experts.py [--device cpu|cuda] [--experts 32] [--layers 6]
        [--hidden 64] [--rows 8] [--seq 64] [--steps 5]

The last line reads ``megatron_experts grouped/loop step time ratio R (...)``.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import torch


def config(args: argparse.Namespace) -> dict[str, Any]:
    from miles_tinypolicy.frontier import frontier_config

    h = args.hidden
    return dict(frontier_config("deepseek_v3"), hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h // 2,
                num_hidden_layers=args.layers, n_routed_experts=args.experts, num_experts_per_tok=4,
                n_group=4, topk_group=2, max_position_embeddings=args.seq)


def batch(args: argparse.Namespace, vocab: int) -> Any:
    from miles import Batch, Sample, Task

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.rows):
        ids = torch.randint(3, vocab, (args.seq,), generator=g).tolist()
        p = args.seq // 4
        rows.append(Sample(Task("x"), prompt_ids=ids[:p], response_ids=ids[p:], logprobs=[0.0] * (args.seq - p)))
    return Batch.from_samples(rows, pad_id=0, advantages=[1.0 if i % 2 else -1.0 for i in range(args.rows)])


def loss_fn(mb: Any, lp: torch.Tensor) -> tuple[torch.Tensor, dict]:
    return -mb.token_mean(lp * mb.advantages.to(lp.device)), {}


def measure(trainer: Any, b: Any, steps: int, device: str) -> dict[str, float]:
    from miles.testing.syncs import OpCounter, count_syncs

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    trainer.train_step(b, loss_fn)
    with OpCounter() as ops:
        trainer.train_step(b, loss_fn)
    syncs = float("nan")
    if device == "cpu":
        with count_syncs() as s:
            trainer.train_step(b, loss_fn)
        syncs = s.total
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        trainer.train_step(b, loss_fn)
        sync()
        times.append(time.perf_counter() - t)
    return {"ops": ops.n, "syncs": syncs, "ms": 1e3 * statistics.median(times)}


def trainers(args: argparse.Namespace, spec: Any, tok: Any):
    """(name, trainer) of each side; megatron's per-expert loop by switching grouping off until the
    caller asks for the next trainer (a generator: its ``finally`` runs when the loop moves on)."""
    from miles_plugin_fsdp2.config import FSDP2Config
    from miles_plugin_fsdp2.trainer import FSDP2Trainer
    from miles_plugin_megatron.config import MegatronConfig
    from miles_plugin_megatron.experts import GroupedExperts
    from miles_plugin_megatron.trainer import MegatronTrainer

    precision = "bf16" if args.device.startswith("cuda") else "fp32"
    for name in ("megatron grouped", "megatron loop"):
        grouped = GroupedExperts._groupable
        if name.endswith("loop"):
            GroupedExperts._groupable = lambda self, x: False
        try:
            cfg = MegatronConfig(device=args.device, precision=precision, lr=1e-4, grad_clip=None)
            yield name, MegatronTrainer(cfg, spec=spec, tokenizer=tok, seed=0, total_steps=100)
        finally:
            GroupedExperts._groupable = grouped
    cfg = FSDP2Config(device=args.device, lr=1e-4, grad_clip=None,
                      mixed_precision="bf16" if precision == "bf16" else None)
    yield "fsdp2", FSDP2Trainer(cfg, spec=spec, tokenizer=tok, seed=0, total_steps=100)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="CPU, 8 experts, 2 layers, 4 rows of 32 tokens (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.device, args.experts, args.layers, args.rows, args.seq, args.steps = "cpu", 8, 2, 4, 32, 1
    if args.device == "cpu":
        torch.set_num_threads(1)
    from miles import make_plugin_manager
    from miles.testing import char_tokenizer, model_spec

    tok = char_tokenizer()
    spec = model_spec(config(args), pm=make_plugin_manager())
    b = batch(args, len(tok))
    print(f"DeepSeek-V3 shape: {args.layers} layers, hidden {args.hidden}, {args.experts} experts (top 4); "
          f"{args.rows} rows x {args.seq} tokens; {args.device}")
    out: dict[str, dict[str, float]] = {}
    stand_ins = contextlib.nullcontext()
    if args.device == "cpu":
        from miles_plugin_megatron.cpu import on_cpu

        stand_ins = on_cpu()
    with stand_ins:
        for name, trainer in trainers(args, spec, tok):
            out[name] = measure(trainer, b, args.steps, args.device)
            r = out[name]
            syncs = "-" if r["syncs"] != r["syncs"] else r["syncs"]  # NaN: not counted on a GPU
            print(f"  {name}: {r['ops']:,} aten ops/step, {syncs} host syncs/step, {r['ms']:.1f} ms/step")
            del trainer
    g, loop, f = out["megatron grouped"], out["megatron loop"], out["fsdp2"]
    print(f"megatron_experts grouped/loop step time ratio {g['ms'] / loop['ms']:.2f} (aten ops {g['ops']:,} / "
          f"{loop['ops']:,}; fsdp2 {f['ops']:,} ops, {f['ms']:.1f} ms; grouped/fsdp2 time {g['ms'] / f['ms']:.2f})")


if __name__ == "__main__":
    main()
