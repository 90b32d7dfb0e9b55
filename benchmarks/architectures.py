#!/usr/bin/env python
"""The frontier architectures (deepseek_v3, deepseek_v4, glm4_moe, glm_moe_dsa, qwen3_5_moe_text,
qwen3_next, gpt_oss) at a ~0.5-1B random shape on one GPU: per family, one table row of

- engine: the built-in torch engine's tokens/s (``impl: hf``, the architecture's own cache) against
  transformers ``generate`` on the same model object and prompts (temperature 1, no EOS, both
  produce prompts x new-tokens tokens), and the engine's log-probs against a transformers forward
  of the same tokens in the same dtype (mean / max |delta|);
- fsdp2: training tokens/s per GPU and MFU as the trainer reports them (``tokens_per_gpu_per_s``,
  ``mfu`` in ``train_step``'s metrics), bf16 mixed precision; megatron likewise;
- R3: mean / max |logp_train - logp_rollout| over response tokens between the engine's samples
  (``--dtype``, experts recorded) and a float32 trainer copy routing by itself (off) and replaying
  the engine's experts (on).

Every model is random (transformers' default init; the router top-k boundaries of a random model
are closer than a trained one's, so R3 off flips more routings than it would on a checkpoint).
Each measure warms up once and is timed with CUDA synchronised. A family that fails prints its
error in its row and the script goes on; it exits 1 when one did.

    python benchmarks/architectures.py --device cuda --dtype bfloat16 [--families deepseek_v3,gpt_oss]
        [--prompts 16] [--new-tokens 32] [--rows 16] [--seq 512] [--steps 2] [--peak-tflops 989]

``--quick``: the same path on CPU at tiny shapes in a float32 engine, for three families by default
(megatron needs CUDA: its cells read "-").
The last line reads ``architectures: N/M families measured``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import sys
import time
import traceback
from typing import Any, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmarks' helpers

FAMILIES = ("deepseek_v3", "deepseek_v4", "glm4_moe", "glm_moe_dsa", "qwen3_5_moe_text", "qwen3_next", "gpt_oss")
MEGATRON = FAMILIES  # the megatron trainer builds every family
# --quick's default: one family per kind of attention (MLA, gated DeltaNet, sliding windows with
# sinks), so the smoke run stays short on 2 shared cores; --families runs any of them
QUICK = ("deepseek_v3", "qwen3_5_moe_text", "gpt_oss")
# ~0.6-0.9B parameters per family on the GPU (32 experts of 512, top-4, over 12 layers of 1024)
SHAPES = {
    "gpu": dict(hidden=1024, layers=12, heads=16, head_dim=64, experts=32, topk=4, moe_inter=512, inter=2816,
                vocab=32000, rank=256, window=128, index_topk=32, positions=1024),
    "tiny": dict(hidden=64, layers=2, heads=4, head_dim=16, experts=8, topk=2, moe_inter=32, inter=128,
                 vocab=128, rank=16, window=8, index_topk=4, positions=128),
}


def config(family: str, s: dict[str, int]) -> dict[str, Any]:
    """``family``'s inline transformers config at shape ``s`` (the key names are each family's own)."""
    H, L, h, d, E, k = s["hidden"], s["layers"], s["heads"], s["head_dim"], s["experts"], s["topk"]
    base = dict(model_type=family, hidden_size=H, num_hidden_layers=L, num_attention_heads=h, vocab_size=s["vocab"],
                max_position_embeddings=s["positions"], tie_word_embeddings=False, num_experts_per_tok=k)
    moe = dict(moe_intermediate_size=s["moe_inter"], n_routed_experts=E, n_shared_experts=1)
    # multi-latent attention (DeepSeek-V3, GLM-5): compressed KV latent, a decoupled RoPE key
    mla = dict(kv_lora_rank=s["rank"], q_lora_rank=s["rank"] * 3 // 2, qk_rope_head_dim=d // 2, qk_nope_head_dim=d,
               v_head_dim=d, num_key_value_heads=h)
    # gated DeltaNet layers, every fourth (and the last) one full attention
    linear = dict(num_key_value_heads=h // 2, head_dim=d, linear_conv_kernel_dim=4, linear_key_head_dim=d,
                  linear_value_head_dim=d, linear_num_key_heads=h // 2, linear_num_value_heads=h,
                  moe_intermediate_size=s["moe_inter"], shared_expert_intermediate_size=s["moe_inter"],
                  num_experts=E,
                  layer_types=["full_attention" if i % 4 == 3 or i == L - 1 else "linear_attention"
                               for i in range(L)])
    if family == "deepseek_v3":  # sigmoid router with expert bias, group-limited top-k (2 experts per group)
        return {**base, **moe, **mla, "intermediate_size": s["inter"], "n_group": 4, "topk_group": k // 2,
                "first_k_dense_replace": 1, "routed_scaling_factor": 2.5}
    if family == "deepseek_v4":  # hash-routed first layer; compressed, then compressed sparse attention
        return {**base, **moe, "num_key_value_heads": 1, "head_dim": 2 * d, "q_lora_rank": s["rank"] * 3 // 2,
                "qk_rope_head_dim": d // 2, "sliding_window": s["window"], "o_groups": 2, "o_lora_rank": s["rank"],
                "index_n_heads": max(2, h // 4), "index_head_dim": d, "index_topk": s["index_topk"], "hc_mult": 2,
                "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"] * (L // 2),
                "mlp_layer_types": ["hash_moe"] + ["moe"] * (L - 1)}
    if family == "glm4_moe":  # GQA with q/k norms and QKV biases, partial RoPE
        return {**base, **moe, "intermediate_size": s["inter"], "num_key_value_heads": h // 2, "head_dim": d,
                "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "use_qk_norm": True,
                "attention_bias": True}
    if family == "glm_moe_dsa":  # MLA with DeepSeek sparse attention's indexer
        return {**base, **moe, **mla, "intermediate_size": s["inter"], "head_dim": d // 2, "n_group": 1,
                "topk_group": 1, "first_k_dense_replace": 1, "index_topk": s["index_topk"], "index_head_dim": d,
                "index_n_heads": 8, "mlp_layer_types": ["dense"] + ["sparse"] * (L - 1),
                "layer_types": ["indexed_attention"] * L, "indexer_types": ["full"] * L}
    if family == "qwen3_5_moe_text":
        return {**base, **linear}
    if family == "qwen3_next":
        return {**base, **linear, "intermediate_size": s["inter"], "norm_topk_prob": True}
    if family == "gpt_oss":  # sliding windows on every other layer, attention sinks
        return {**base, "intermediate_size": s["moe_inter"], "num_local_experts": E, "num_key_value_heads": h // 4 or 1,
                "head_dim": d, "sliding_window": s["window"],
                "layer_types": ["sliding_attention", "full_attention"] * (L // 2)}
    raise SystemExit(f"--families: unknown family {family!r}; choose from {', '.join(FAMILIES)}")


class Tok:
    """The three things the engine, the specs and the trainers read from a tokenizer."""

    eos_token_id = None
    pad_token_id = 0

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab


@functools.cache
def plugin_manager() -> Any:
    from miles import make_plugin_manager

    return make_plugin_manager()  # discovering the plugins takes seconds: once per run


def make_spec(cfg: dict[str, Any], replay: bool, device: str | None):
    """The ``hf`` model spec over ``cfg`` (``moe`` with routing replay over it when ``replay``),
    through the plugin manager as a recipe names it. With ``device`` its models are built there
    directly (a CPU init of a 1B model costs more than the measure)."""
    import torch

    pm = plugin_manager()
    if replay:
        spec = pm.create("model_specs", "moe", pm.registry("model_specs")["moe"].config(
            base={"name": "hf", "config": cfg}, routing_replay=True), pm=pm)
    else:
        spec = pm.create("model_specs", "hf", pm.registry("model_specs")["hf"].config(config=cfg), pm=pm)
    if device is not None:
        build = spec.build_model

        def on_device(tokenizer: Any) -> torch.nn.Module:
            with torch.device(device):
                return build(tokenizer)
        spec.build_model = on_device
    return spec


def mean_max(d: Any) -> str:
    return f"{float(d.mean()):.3g}/{float(d.max()):.3g}"


def engine_calls(cfg: dict[str, Any], tok: Tok, device: str, dtype: str, P: int, T: int, N: int):
    """The generic-path engine of a family's random model, its ``P x T`` prompts, and two calls
    that each produce ``P x N`` tokens on the same model object: ``run_engine`` (the engine, its
    completions kept in ``out``) and ``run_generate`` (transformers ``generate``, temperature 1,
    no EOS)."""
    import torch
    from miles import SamplingParams
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    torch.manual_seed(0)
    engine = TorchEngine(TorchEngineConfig(device=device, dtype=dtype, impl="hf", max_batch_size=P),
                         spec=make_spec(cfg, False, device), tokenizer=tok, seed=0)
    model = engine.model
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompts = torch.randint(1, cfg["vocab_size"], (P, T), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {}

    def run_engine(tokens: int = N) -> None:
        groups = engine.generate(prompts.tolist(), SamplingParams(temperature=1.0, top_p=1.0, top_k=0,
                                                                  max_new_tokens=tokens, seed=0))
        assert {len(g[0].token_ids) for g in groups} == {tokens}, "the engine stopped early"
        out["completions"] = groups

    ids = prompts.to(device)

    def run_generate(tokens: int = N) -> None:
        with torch.inference_mode():
            got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=tokens,
                                 min_new_tokens=tokens)
        assert got.shape == (P, T + tokens), got.shape

    return engine, prompts, out, run_engine, run_generate


@contextlib.contextmanager
def without_graphs(engine: Any) -> Iterator[None]:
    """The engine with its decode steps run eagerly (CUDA graphs off), inside."""
    runner = engine._fast.runner if engine._fast is not None else None
    static, graphs = engine._static, runner is not None and runner.use_graphs
    engine._static = False
    if runner is not None:
        runner.use_graphs = False
    try:
        yield
    finally:
        engine._static = static
        if runner is not None:
            runner.use_graphs = graphs


def uses_graphs(engine: Any) -> bool:
    """Whether the engine replays its decode steps from CUDA graphs (the continuous batcher's
    runner, or the per-call path's static cache)."""
    return engine._static or (engine._fast is not None and engine._fast.runner.use_graphs)


def engine_row(cfg: dict[str, Any], args, tok: Tok) -> dict[str, str]:
    """Engine vs ``generate`` tokens/s and engine vs forward log-probs."""
    import torch
    from engine_vs_hf import timed

    P, T, N = args.prompts, args.prompt_len, args.new_tokens
    engine, prompts, out, run_engine, run_generate = engine_calls(cfg, tok, args.device, args.dtype, P, T, N)
    model = engine.model
    run_engine()  # warm-up at the timed length: a first call at a new length pays one-time costs
    run_generate()
    eng, gen = P * N / timed(run_engine, args.device)[0], P * N / timed(run_generate, args.device)[0]
    eager = "-"
    if uses_graphs(engine):  # the same engine with its decode steps eager
        with without_graphs(engine):
            run_engine()
            eager = f"{P * N / timed(run_engine, args.device)[0]:,.0f}"
        run_engine()  # the completions compared below come from the graphs
    response = torch.tensor([g[0].token_ids for g in out["completions"]])
    with torch.inference_mode():
        logits = model(input_ids=torch.cat([prompts, response], 1).to(args.device), use_cache=False).logits
        ref = torch.log_softmax(logits[:, T - 1:-1].float(), -1).gather(-1, response.to(args.device)[..., None])[..., 0]
    diff = (ref.cpu() - torch.tensor([g[0].logprobs for g in out["completions"]])).abs()
    params = sum(p.numel() for p in model.parameters())
    return {"params": f"{params / 1e6:,.{0 if params > 1e8 else 2}f}M", "engine tok/s": f"{eng:,.0f}",
            "eager tok/s": eager,
            "generate tok/s": f"{gen:,.0f}", "ratio": f"{eng / gen:.2f}x", "|dlogp| mean/max": mean_max(diff)}


def trainer_cells(kind: str, cfg: dict[str, Any], args, tok: Tok) -> tuple[str, str]:
    """(tokens/s per GPU, MFU) of ``kind``'s train step as its metrics report them (the last timed step)."""
    import torch
    from trainer_megatron_vs_fsdp2 import loss_fn, make_batch

    if kind == "megatron":
        from miles_plugin_megatron.config import MegatronConfig
        from miles_plugin_megatron.trainer import MegatronTrainer

        trainer = MegatronTrainer(MegatronConfig(device=args.device, precision="bf16", micro_batch_size=args.micro,
                                                 lr=1e-5, peak_tflops=args.peak_tflops),
                                  spec=make_spec(cfg, False, None), tokenizer=tok, total_steps=10)
    else:
        from miles_plugin_fsdp2.config import FSDP2Config
        from miles_plugin_fsdp2.trainer import FSDP2Trainer

        fsdp = FSDP2Config(device=args.device, shard=args.device.startswith("cuda"), mixed_precision="bf16",
                           micro_batch_size=args.micro, lr=1e-5, peak_tflops=args.peak_tflops)
        trainer = FSDP2Trainer(fsdp, spec=make_spec(cfg, False, args.device), tokenizer=tok, total_steps=10)
    batch = make_batch(args.rows, args.seq, args.seq // 8, cfg["vocab_size"])
    trainer.train_step(batch, loss_fn)  # warm-up: allocator, kernels, optimizer state
    for _ in range(args.steps):
        m = trainer.train_step(batch, loss_fn)
    del trainer
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    mfu = f"{100 * m['mfu']:.1f}%" if "mfu" in m else "-"
    return f"{m['tokens_per_gpu_per_s']:,.0f}", mfu


def r3_cells(cfg: dict[str, Any], args, tok: Tok) -> dict[str, str]:
    """R3 off and on: the float32 trainer copy's log-probs of the engine's samples."""
    import torch
    from mismatch import abs_diff, plain_logprobs, rollout

    torch.manual_seed(0)
    spec = make_spec(cfg, True, args.device)
    master = spec.build_model(tok).float().eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, cfg["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()
    with torch.no_grad():
        batch = rollout(spec, tok, master, prompts, 1, 0, dtype=args.dtype)
        off, on = abs_diff(plain_logprobs(master, batch), batch), abs_diff(spec.action_logprobs(master, batch), batch)
    del master
    return {"R3 off mean/max": mean_max(off), "R3 on mean/max": mean_max(on)}


def measure(family: str, args) -> dict[str, str]:
    cfg = config(family, SHAPES[args.shape])
    tok = Tok(cfg["vocab_size"])
    row = engine_row(cfg, args, tok)
    row["fsdp2 tok/s"], row["fsdp2 MFU"] = trainer_cells("fsdp2", cfg, args, tok)
    if family in MEGATRON and args.device.startswith("cuda"):
        row["megatron tok/s"], row["megatron MFU"] = trainer_cells("megatron", cfg, args, tok)
    row.update(r3_cells(cfg, args, tok))
    return row


COLUMNS = ("params", "engine tok/s", "eager tok/s", "generate tok/s", "ratio", "|dlogp| mean/max", "fsdp2 tok/s",
           "fsdp2 MFU", "megatron tok/s", "megatron MFU", "R3 off mean/max", "R3 on mean/max")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the engine's dtype")
    ap.add_argument("--families", default=None, help="comma-separated, from: " + ", ".join(FAMILIES) +
                    f" (default: all; --quick: {','.join(QUICK)})")
    ap.add_argument("--prompts", type=int, default=16, help="engine and R3: prompts (one sample each)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32, help="engine: new tokens per prompt (R3: 8)")
    ap.add_argument("--rows", type=int, default=16, help="training: rows per step")
    ap.add_argument("--seq", type=int, default=512, help="training: tokens per row (an eighth of them prompt)")
    ap.add_argument("--micro", type=int, default=8, help="training: micro-batch rows")
    ap.add_argument("--steps", type=int, default=2, help="training: timed steps after one warm-up")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's dense bf16 peak for MFU (default: the trainers' table by device name)")
    ap.add_argument("--quick", action="store_true", help="CPU, one thread, tiny shapes, float32 engine, 2 prompts, "
                    "2 rows of 32 tokens (a smoke run)")
    args = ap.parse_args(argv)
    args.shape = "gpu"
    if args.quick:
        args.device, args.shape, args.prompts, args.prompt_len, args.new_tokens = "cpu", "tiny", 2, 8, 4
        args.dtype = "float32"  # CPU bfloat16 kernels are slow paths; the smoke run checks the code path
        args.rows, args.seq, args.micro, args.steps = 2, 32, 2, 1
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; use --device cpu (or --quick)")
    if args.device == "cpu":  # --quick: one thread (tiny ops gain nothing from a second, which spins on busy cores)
        torch.set_num_threads(1 if args.quick else min(2, torch.get_num_threads()))
    chosen = args.families or ",".join(QUICK if args.quick else FAMILIES)
    families = [f.strip() for f in chosen.split(",") if f.strip()]
    for f in families:
        config(f, SHAPES["tiny"])  # an unknown name exits before any model is built
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"{where}, torch {torch.__version__}; shape {args.shape} {SHAPES[args.shape]}; engine {args.dtype}, "
          f"{args.prompts} prompts x {args.prompt_len} + {args.new_tokens} new tokens; training {args.rows} rows x "
          f"{args.seq} tokens, micro-batch {args.micro}, {args.steps} timed step(s)", flush=True)
    print(" | ".join(["family", *COLUMNS]), flush=True)
    ok = 0
    for family in families:
        t0 = time.perf_counter()
        try:
            row = measure(family, args)
            ok += 1
            cells = [row.get(c, "-") for c in COLUMNS]
            print(" | ".join([family, *cells, f"({time.perf_counter() - t0:.0f} s)"]), flush=True)
        except Exception as e:  # one family's failure is its row; the others still run
            at = traceback.extract_tb(e.__traceback__)[-1]
            print(f"{family} | failed after {time.perf_counter() - t0:.0f} s: {type(e).__name__}: {e} "
                  f"(at {os.path.basename(at.filename)}:{at.lineno})", flush=True)
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"architectures: {ok}/{len(families)} families measured")
    return 0 if ok == len(families) else 1


if __name__ == "__main__":
    sys.exit(main())
