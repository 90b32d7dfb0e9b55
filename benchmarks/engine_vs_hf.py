#!/usr/bin/env python
"""Tokens/s of miles' built-in ``torch`` engine against transformers ``generate``: same model object,
same prompts, same sampling (temperature 1, no top-k/top-p), same number of new tokens, one run.

GPU (default): a randomly initialised Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4864, vocab 151936, tied embeddings) in bf16; 256 prompts of 128 random
tokens, 256 new tokens each. The engine runs its fast path (``impl: fast``: KV cache allocated
once, continuous batching, CUDA graphs) with ``max_batch_size`` 256; the same engine with graphs
off is measured too.
``--device cpu``: the same benchmark with the quickstart model (recipes/quickstart.yaml's
``model.config`` over the arith char vocabulary, its RoPE table sized to the shape) in float32 on
one thread: the same 256 prompts of 128 tokens and 256 new tokens each, with both the fast path
(on CPU its own prefill/decode steps, ``cpu_decode.py``; the CPU float32 default) and the generic
(``impl: hf``) engine path measured. ``--prompts 64 --prompt-len 32 --new-tokens 64`` is a shape
closer to the quickstart's own rollouts (short, so fixed per-op costs weigh more there). On a
shared machine other processes slow some runs down (and cost more to the side whose step is more
cache-bound), so the CPU default is 5 alternating repeats; the thread CPU time of each side's best
run is printed too.

Neither side stops early: ``generate`` gets no EOS id, the engine no stop ids, so both produce
exactly prompts x new-tokens tokens (checked). The engine also returns every token's log-prob;
``generate`` is not asked for scores. Each side is warmed up once (the engine's warm-up captures its
CUDA graphs), then timed; the sides alternate and each side's best run counts (other processes only
ever slow a run down).

Usage: python benchmarks/engine_vs_hf.py [--device cuda|cpu] [--repeats N]
Ends with one line: ``engine_vs_hf tokens/s ratio: <x> (miles <tok/s> vs generate <tok/s>)``.
"""
from __future__ import annotations

import argparse
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_MODEL = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)
SHAPES = {"cuda": dict(prompts=256, prompt_len=128, new_tokens=256, dtype="bfloat16"),
          "cpu": dict(prompts=256, prompt_len=128, new_tokens=256, dtype="float32")}


class _Prebuilt:
    """A model spec handing the engine the already built model (so both sides share weights)."""

    def __init__(self, model):
        self.model = model

    def build_model(self, tokenizer):
        return self.model


class _Tok:  # the engine only reads these two ids from its tokenizer
    eos_token_id = None
    pad_token_id = 0


def model_config(device: str) -> dict:
    if device != "cpu":
        return dict(GPU_MODEL)
    import yaml
    from miles.testing import char_tokenizer

    with open(os.path.join(ROOT, "recipes", "quickstart.yaml")) as f:
        cfg = dict(yaml.safe_load(f)["model"]["config"])
    cfg.pop("model_type")
    shape = SHAPES["cpu"]
    cfg["vocab_size"] = len(char_tokenizer())
    cfg["max_position_embeddings"] = shape["prompt_len"] + shape["new_tokens"]
    return cfg


def build(device: str):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dtype = getattr(torch, SHAPES["cpu" if device == "cpu" else "cuda"]["dtype"])
    torch.manual_seed(0)
    cfg = Qwen2Config(pad_token_id=0, eos_token_id=None, bos_token_id=None, **model_config(device))
    with torch.device(device):  # initialise in place: a CPU init of 0.5B parameters takes long
        model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_engine(model, device: str, impl: str, rows: int, graphs: bool = True):
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    dtype = SHAPES["cpu" if device == "cpu" else "cuda"]["dtype"]
    cfg = TorchEngineConfig(device=device, dtype=dtype, max_batch_size=rows, impl=impl, cuda_graphs=graphs)
    return TorchEngine(cfg, spec=_Prebuilt(model), tokenizer=_Tok(), seed=0)


def timed(fn, device: str) -> tuple[float, float]:
    """Wall seconds of ``fn()`` and the calling thread's CPU seconds (meaningful on CPU only)."""
    import torch

    if device != "cpu":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.thread_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per side (cuda 1, cpu 5)")
    for key in ("prompts", "prompt_len", "new_tokens"):
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help="override the shape")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU: torch threads of both sides (the engine splits its rows among as many "
                         "workers, generate runs its ops on as many intra-op threads)")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (generate: num_return_sequences)")
    ap.add_argument("--quick", action="store_true", help="CPU, 4 prompts of 8 tokens, 8 new tokens, 1 repeat "
                    "(a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.device, args.repeats, args.prompts, args.prompt_len, args.new_tokens = "cpu", 1, 4, 8, 8
    import torch
    from miles import SamplingParams

    device = args.device
    shape = SHAPES["cpu" if device == "cpu" else "cuda"]
    for key in ("prompts", "prompt_len", "new_tokens"):
        shape[key] = getattr(args, key) or shape[key]
    repeats = args.repeats or (5 if device == "cpu" else 1)
    if device == "cpu":
        torch.set_num_threads(args.threads)
    model = build(device)
    P, T, N, S = shape["prompts"], shape["prompt_len"], shape["new_tokens"], args.n
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, model.config.vocab_size, (P, T), generator=g)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=N, seed=0)

    def engine_run(eng):
        groups = eng.generate(prompts.tolist(), params, n=S)
        lengths = [len(c.token_ids) for grp in groups for c in grp]
        assert set(lengths) == {N} and len(lengths) == P * S, f"engine produced lengths {set(lengths)}"
        return P * S * N

    ids = prompts.to(device)

    def hf_run(new_tokens=N):
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, num_return_sequences=S)
        assert out.shape == (P * S, T + new_tokens), out.shape
        return P * S * new_tokens

    sides = {"miles": make_engine(model, device, "fast", P * S)}
    if device == "cpu":
        sides["miles (impl hf)"] = make_engine(model, device, "hf", P * S)
    else:  # what the CUDA graphs buy
        sides["miles (no graphs)"] = make_engine(model, device, "fast", P * S, graphs=False)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in [*sides, "generate"]}
    for eng in sides.values():
        engine_run(eng)  # warm-up: allocates the KV cache, captures the CUDA graphs
    hf_run(8)
    for _ in range(repeats):
        for name, eng in sides.items():
            times[name].append(timed(lambda e=eng: engine_run(e), device))
        times["generate"].append(timed(hf_run, device))
    rate = {name: P * S * N / min(t for t, _ in ts) for name, ts in times.items()}
    cpu = {name: min(c for _, c in ts) for name, ts in times.items()}
    where = torch.cuda.get_device_name(device) if device != "cpu" else f"CPU, {args.threads} thread(s)"
    print(f"{where}: {P} prompts x {T} tokens, {S} sample(s) of {N} new tokens each, {shape['dtype']}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    for name, ts in times.items():
        extra = f", best thread CPU time {cpu[name]:.3f}s" if device == "cpu" else ""
        runs = ", ".join(f"{t:.2f}s" for t, _ in ts)
        print(f"  {name:16s} {rate[name]:>12,.0f} tokens/s  (runs: {runs}{extra})")
    if device == "cpu":
        print(f"thread CPU time ratio: {cpu['generate'] / cpu['miles']:.2f}x (generate / miles)")
    print(f"engine_vs_hf tokens/s ratio: {rate['miles'] / rate['generate']:.2f}x "
          f"(miles {rate['miles']:,.0f} vs generate {rate['generate']:,.0f})")


if __name__ == "__main__":
    main()
