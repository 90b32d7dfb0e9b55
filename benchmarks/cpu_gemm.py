#!/usr/bin/env python
"""oneDNN against MKL (torch's default CPU BLAS) for the GEMMs of the CPU fast paths, on this CPU.

The layers of grpo_step_vs_trl's larger model (Qwen2, hidden 256, 6 layers, 8 heads / 4 KV
heads, FFN 1024), float32, one thread (each fast-path worker runs one):
- decode: one step's q|k|v, o, gate|up and down GEMMs at 64 rows (a worker's share of 128),
  MKL on ``[in, out]`` weight copies (the engine's layout for it) against oneDNN on packed weights;
- training: each linear's forward (``x @ W.T``) and input gradient (``dy @ W``) over 2,032 tokens
  (a worker's share of the larger shape's batch), MKL against oneDNN on the plain weight;
- the weight gradient (``dy.T @ x``), which stays in MKL, for scale.
Each ratio is MKL's time over oneDNN's (best of ``--repeats`` alternating runs); ``auto`` in
``engine.cpu_gemm`` / ``trainer.cpu_gemm`` picks oneDNN only on AMD CPUs (``miles_fastpath.cpu_gemm``).

Usage: python benchmarks/cpu_gemm.py [--repeats N]
"""
from __future__ import annotations

import argparse
import time

HIDDEN, FFN, LAYERS, Q, KV = 256, 1024, 6, 256, 128
DECODE = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * FFN, HIDDEN), (HIDDEN, FFN)]  # (out, in), fused
TRAIN = [(Q, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, Q), (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)]


def clock(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one repeat (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 1
    import torch
    from miles_fastpath import cpu_gemm

    torch.set_num_threads(1)
    if not cpu_gemm.onednn_available():
        print("cpu_gemm: this torch build has no oneDNN linear op")
        return 1
    torch.manual_seed(0)
    dec = [[torch.randn(o, i) for o, i in DECODE] for _ in range(LAYERS)]
    dec_io = [[w.t().contiguous() for w in layer] for layer in dec]
    dec_packed = [[cpu_gemm.pack(w) for w in layer] for layer in dec]
    xs = {i: torch.randn(64, i) for _, i in DECODE}
    train = [torch.randn(o, i) for o, i in TRAIN]
    tx = {i: torch.randn(2032, i) for _, i in TRAIN}
    dy = {o: torch.randn(2032, o) for o, _ in TRAIN}
    cases = {
        "decode step, 64 rows": (
            lambda: [torch.mm(xs[w.shape[0]], w) for layer in dec_io for w in layer],
            lambda: [cpu_gemm.linear(xs[w.shape[1]], p) for layer, ps in zip(dec, dec_packed)
                     for w, p in zip(layer, ps)], 20),
        "training forward, a layer": (
            lambda: [torch.nn.functional.linear(tx[w.shape[1]], w) for w in train],
            lambda: [cpu_gemm.linear(tx[w.shape[1]], w) for w in train], 3),
        "input gradient, a layer": (
            lambda: [dy[w.shape[0]].mm(w) for w in train],
            lambda: [cpu_gemm.linear(dy[w.shape[0]], w.t()) for w in train], 3),
    }
    with torch.inference_mode():
        print(f"CPU vendor {cpu_gemm.cpu_vendor() or 'unknown'}; auto picks {cpu_gemm.resolve('auto')}; "
              f"torch {torch.__version__}, 1 thread, float32, best of {args.repeats}")
        for name, (mkl, dnnl, calls) in cases.items():
            a, b = [], []
            for _ in range(args.repeats):
                a.append(clock(mkl, calls))
                b.append(clock(dnnl, calls))
            print(f"  {name:<28} MKL {min(a) * 1e3:7.2f} ms  oneDNN {min(b) * 1e3:7.2f} ms  "
                  f"MKL / oneDNN = {min(a) / min(b):.2f}x")
        wg = min(clock(lambda: [dy[w.shape[0]].t().mm(tx[w.shape[1]]) for w in train], 3)
                 for _ in range(args.repeats))
        print(f"  {'weight gradient (MKL)':<28} {wg * 1e3:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
