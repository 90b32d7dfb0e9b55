#!/usr/bin/env python
"""Where the engine's generic path (``impl: hf``) spends a generate call, per architecture, against
transformers ``generate`` on the same model object and prompts, and on CUDA against the same engine
without its CUDA graphs (over the growing cache): wall time after one warm-up call of the same
length, host synchronisations (CUDA sync debug mode, counted by ``file:line``), aten calls, kernel
launches and GPU busy time (torch profiler), and the profiler's top host ops.

    python benchmarks/engine_profile.py [--families qwen3_next,glm_moe_dsa] [--prompts 8]
        [--prompt-len 64] [--new-tokens 24] [--table]

The models are the random ~0.7B shapes of ``architectures.py`` on CUDA (its tiny ones on CPU, where
host syncs are not counted). ``--quick``: CPU, one family, 2 prompts, 4 new tokens. The last line
reads ``engine_profile: N families profiled``.
"""
from __future__ import annotations

import argparse
import collections
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import architectures as A  # noqa: E402


def _syncs(fn) -> collections.Counter:
    """Host synchronisations of one call, by the file:line that asked for them."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            fn()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return collections.Counter(f"{w.filename.split('site-packages/')[-1]}:{w.lineno}" for w in ws
                               if "synchroniz" in str(w.message))


def profile_family(family: str, args, device: str) -> None:
    from engine_vs_hf import timed

    cuda = device.startswith("cuda")
    cfg = A.config(family, A.SHAPES["gpu" if cuda else "tiny"])
    engine, _, _, run_engine, run_generate = A.engine_calls(cfg, A.Tok(cfg["vocab_size"]), device,
                                                            "bfloat16" if cuda else "float32", args.prompts,
                                                            args.prompt_len, args.new_tokens)

    def run_eager() -> None:  # the same engine, its decode steps eager
        with A.without_graphs(engine):
            run_engine()

    times = {}
    for name, fn in (("engine", run_engine), ("engine eager", run_eager), ("generate", run_generate)):
        if name == "engine eager" and not A.uses_graphs(engine):  # no CUDA graphs for this family (or on CPU)
            continue
        fn()  # warm-up at the timed length: one-time costs (kernel selection, lazy init) stay out
        seconds = times[name] = timed(fn, device)[0]
        print(f"{family} {name}: {seconds:.3f} s for {args.prompts} x {args.new_tokens} tokens", flush=True)
        if cuda:
            where = _syncs(fn)
            print(f"  syncs: {sum(where.values())}: " + "; ".join(f"{k} x{v}" for k, v in where.most_common(6)))
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
        ka = prof.key_averages()
        launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
        print(f"  ops: {sum(e.count for e in ka if e.key.startswith('aten::'))} aten calls, {launches} launches; "
              f"GPU busy {sum(e.self_device_time_total for e in ka) / 1e3:.1f} ms")
        if args.table:
            print(ka.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=45))
    ratios = [f"engine {times['generate'] / times['engine']:.2f}x generate"]
    if "engine eager" in times:
        ratios.append(f"CUDA graphs {times['engine eager'] / times['engine']:.2f}x eager")
    print(f"{family}: " + ", ".join(ratios), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    ap.add_argument("--families", default="qwen3_next,glm_moe_dsa", help="comma-separated, from: " +
                    ", ".join(A.FAMILIES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--table", action="store_true", help="also print the profiler's top host ops")
    ap.add_argument("--quick", action="store_true", help="CPU, qwen3_next, 2 prompts of 16, 4 new tokens")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        device, args.families, args.prompts, args.prompt_len, args.new_tokens = "cpu", "qwen3_next", 2, 16, 4
        torch.set_num_threads(1)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in A.FAMILIES]
    if unknown:
        sys.exit(f"engine_profile: unknown --families {unknown}; choose from {', '.join(A.FAMILIES)}")
    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")
    for family in families:
        profile_family(family, args, device)
        if device.startswith("cuda"):  # the family's model is gone with its frame
            torch.cuda.empty_cache()
    print(f"engine_profile: {len(families)} families profiled")


if __name__ == "__main__":
    main()
