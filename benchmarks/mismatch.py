"""Rollout/training log-prob mismatch with and without rollout routing replay (R3), and with FP8
engine weights.

The engine samples in bfloat16 (weights cast from the trainer's), the trainer scores the same
samples in float32 with its master weights; printed: mean and max |logp_train - logp_rollout|
over response tokens (``train_rollout_logprob_abs_diff``) for a dense model, for an MoE model
routed by the trainer itself (R3 off) and with the engine's experts replayed (R3 on); the share
of (token, layer) routings whose top-k set differs between engine and trainer, and the per-token
difference split by whether a flip happened at or before the token's position (a flip changes
every later position through attention).

What R3 can remove is the part of the difference that flips cause; the rest (bfloat16 rounding of
every weight and activation) stays. How much a flip costs depends on the model: how many experts
share a token (``--top-k``), how close the router's top-k boundary is (more ``--experts``: more
flips; the top-k choice does not depend on the router weights' scale, only on their direction),
and how much the experts' output weighs in the residual stream (``--expert-scale`` multiplies
the experts' down projections after init; trained MoE models' experts are specialised and
matter, random small ones barely do). The defaults are Qwen3-MoE-style routing (softmax, top-k
renormalised) with 128 experts, top-4 (Qwen3-30B-A3B routes over 128).

    python benchmarks/mismatch.py [--prompts 16] [--n 2] [--seed 0] [--seeds 1] [--experts 128]
                                  [--top-k 4] [--expert-scale 3] [--skip-fp8] [--device cpu|cuda]
                                  [--shape tiny|0.5b]

On ``--device cuda`` the engine and the trainer's model run on the GPU (the same dtypes), and the
FP8 rows run FP8 GEMMs (``torch._scaled_mm``) where the GPU has them (compute capability >= 8.9).
"""
from __future__ import annotations

import argparse

import torch
from miles import Batch, SamplingParams, Sample, Task

# model shapes (--shape): ``tiny`` runs in seconds on CPU; ``0.5b`` is a Qwen3-MoE of about 0.5B
# parameters for a GPU: hidden 1024, 16 layers and 64 experts leave 128 per expert for 0.5B in all
# (Qwen3-MoE's wider experts would make it 0.8B+). The dense row's MLP is as wide as the MoE's
# active experts together (top-k x expert width).
SHAPES = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "max_position_embeddings": 64, "initializer_range": 0.1,
             "moe_intermediate_size": 64, "experts": 128},
    "0.5b": {"hidden_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
             "head_dim": 64, "max_position_embeddings": 64, "initializer_range": 0.02, "vocab_size": 32000,
             "tie_word_embeddings": False, "moe_intermediate_size": 128, "experts": 64},
}


def sizes(args) -> dict:
    return {k: v for k, v in SHAPES[args.shape].items() if k not in ("moe_intermediate_size", "experts")}


def dense_config(args) -> dict:
    inter = 128 if args.shape == "tiny" else args.top_k * SHAPES[args.shape]["moe_intermediate_size"]
    return {"model_type": "qwen3", "intermediate_size": inter, **sizes(args)}


def moe_config(args) -> dict:
    return {"model_type": "qwen3_moe", "intermediate_size": 128,
            "moe_intermediate_size": SHAPES[args.shape]["moe_intermediate_size"],
            "num_experts": args.experts, "num_experts_per_tok": args.top_k, "norm_topk_prob": True, **sizes(args)}


def build(config: dict, replay: bool):
    from miles_plugin_arith.env import char_tokenizer
    from miles_plugin_moe.config import MoESpecConfig
    from miles_plugin_moe.spec import make_spec
    from miles_plugin_hf.config import HFModelConfig
    from miles_plugin_hf.spec import HFModelSpec

    tok = char_tokenizer()
    if config["model_type"] == "qwen3_moe":
        spec = make_spec(MoESpecConfig(base={"name": "hf", "config": config}, routing_replay=replay))
    else:
        spec = HFModelSpec(HFModelConfig(config=config))
    return spec, tok


def build_moe(args, seed: int):
    torch.manual_seed(seed)
    spec, tok = build(moe_config(args), replay=True)
    master = spec.build_model(tok).eval().to(args.device)
    with torch.no_grad():
        for name, p in master.named_parameters():
            if name.endswith("mlp.experts.down_proj"):
                p.mul_(args.expert_scale)
    return spec, tok, master


def rollout(spec, tok, master: torch.nn.Module, prompts: list[list[int]], n: int, seed: int,
            dtype: str = "bfloat16", weights: str = "model", gemm: str = "auto") -> Batch:
    """The engine's samples of ``prompts`` as a training batch on the trainer's (``master``'s) device."""
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    device = next(master.parameters()).device
    cfg = TorchEngineConfig(dtype=dtype, impl="hf", weights_dtype=weights, fp8_gemm=gemm, device=str(device))
    engine = TorchEngine(cfg, spec=spec, tokenizer=tok, seed=seed)
    engine.load_weights(master.state_dict().items(), 1)
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8), n=n)
    samples = [Sample(task=Task(prompt=""), prompt_ids=p, response_ids=c.token_ids, logprobs=c.logprobs,
                      loss_mask=[1] * len(c.token_ids), extensions=dict(c.extras))
               for p, cs in zip(prompts, outs) for c in cs]
    batch = Batch.from_samples(samples, tok.pad_token_id)
    return batch.to(device)


def plain_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False)
    logits = out.logits[:, batch.prompt_len - 1:-1].float()
    targets = batch.input_ids[:, batch.prompt_len:]
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def abs_diff(lp: torch.Tensor, batch: Batch) -> torch.Tensor:
    """|logp_train - logp_rollout| of every response token (flattened, on CPU)."""
    return (lp - batch.rollout_logprobs).abs()[batch.loss_mask.bool()].cpu()


def flips(model: torch.nn.Module, batch: Batch) -> tuple[float, torch.Tensor]:
    """(share of recorded (token, layer) routings whose expert set the trainer would choose
    otherwise, per response token (flattened like :func:`abs_diff`): whether a flip happened at or
    before the position that predicts it)."""
    from miles_plugin_moe.spec import routing_state

    state = routing_state(model)
    with state.recording():
        plain_logprobs(model, batch)
    own = state.take()[0].view(len(batch), batch.input_ids.shape[1], state.num_layers, state.top_k)
    after = torch.zeros(batch.loss_mask.shape, dtype=torch.bool)  # CPU, like the recorded experts
    flipped = total = 0
    for row, s in enumerate(batch.samples):
        rec = s.extensions["moe"]["routed_experts"]
        start = batch.prompt_len - len(s.prompt_ids)
        mine = own[row, start:start + rec.shape[0]]
        per = (rec.sort(-1).values != mine.sort(-1).values).any(-1)  # [tokens, layers]
        flipped, total = flipped + int(per.sum()), total + per.numel()
        seen = per.any(-1).cumsum(0) > 0
        # response token j is predicted at position len(prompt) + j - 1
        pos = (torch.arange(len(s.response_ids)) + len(s.prompt_ids) - 1).clamp(max=rec.shape[0] - 1)
        after[row, :len(s.response_ids)] = seen[pos]
    return flipped / max(total, 1), after[batch.loss_mask.cpu().bool()]


def prompts_for(tok, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randint(10, 100, (count, 2), generator=g).tolist()
    return [tok(f"{a}+{b}=", add_special_tokens=False)["input_ids"] for a, b in pairs]


def report(name: str, d: torch.Tensor) -> None:
    print(f"{name:<36} train_rollout_logprob_abs_diff mean {float(d.mean()):.5f}  max {float(d.max()):.5f}")


def _mean(d: torch.Tensor) -> str:
    return f"{float(d.mean()):.5f}" if d.numel() else "-"


def moe_rows(tag: str, runs: list[tuple]) -> None:
    """R3 off and on over rollout batches ``(spec, trainer model, batch)`` (pooled), with the
    flips and the per-token split by them."""
    offs, ons, afters, shares = [], [], [], []
    for spec, master, batch in runs:
        offs.append(abs_diff(plain_logprobs(master, batch), batch))
        ons.append(abs_diff(spec.action_logprobs(master, batch), batch))
        share, after = flips(master, batch)
        shares.append(share)
        afters.append(after)
    off, on, after = torch.cat(offs), torch.cat(ons), torch.cat(afters)
    report(f"moe {tag}, R3 off", off)
    report(f"moe {tag}, R3 on", on)
    print(f"  routing flips: {sum(shares) / len(shares):.4f} of (token, layer) routings; "
          f"{float(after.float().mean()):.3f} of response tokens come after one")
    print(f"  per-token mean |diff| R3 off / on: after a flip {_mean(off[after])} / {_mean(on[after])}; "
          f"no flip {_mean(off[~after])} / {_mean(on[~after])}; R3 mean-diff reduction "
          f"{float(off.mean()) / max(float(on.mean()), 1e-12):.1f}x")


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1, help="MoE rows: pool this many seeds (model, prompts, samples)")
    ap.add_argument("--tis-cap", type=float, default=2.0)
    ap.add_argument("--experts", type=int, default=None, help="default: the shape's (tiny 128, 0.5b 64)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-scale", type=float, default=3.0,
                    help="experts' down projections multiplied by this after init (their output's weight)")
    ap.add_argument("--skip-fp8", action="store_true")
    ap.add_argument("--fp8-gemm", default="auto", choices=["auto", "scaled_mm", "dequantized"],
                    help="the FP8 engine's GEMMs (engine.fp8_gemm): FP8 GEMMs or weight-only FP8")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="engine and trainer device")
    ap.add_argument("--shape", default="tiny", choices=list(SHAPES), help="model size (see SHAPES)")
    ap.add_argument("--quick", action="store_true", help="tiny shape, 2 prompts, 16 experts, CPU, one thread "
                    "(a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.n, args.experts, args.shape, args.device = 2, 1, 16, "tiny", "cpu"
        torch.set_num_threads(1)  # tiny ops gain nothing from a second thread, which spins when cores are busy
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; use --device cpu")
    if args.experts is None:
        args.experts = SHAPES[args.shape]["experts"]
    header(args)

    torch.manual_seed(args.seed)
    spec, tok = build(dense_config(args), replay=False)
    prompts = prompts_for(tok, args.prompts, args.seed)
    master = spec.build_model(tok).eval().to(args.device)
    batch = rollout(spec, tok, master, prompts, args.n, args.seed)
    report("dense bf16 engine", abs_diff(plain_logprobs(master, batch), batch))

    print(f"moe: {args.experts} experts, top-{args.top_k}, expert scale {args.expert_scale}, "
          f"seeds {args.seed}..{args.seed + args.seeds - 1} pooled")
    runs = []
    for seed in range(args.seed, args.seed + args.seeds):  # a model and prompts per seed
        spec, tok, master = build_moe(args, seed)
        runs.append((spec, master, rollout(spec, tok, master, prompts_for(tok, args.prompts, seed), args.n, seed)))
    moe_rows("bf16 engine", runs)
    if not args.skip_fp8:
        fp8_rows(prompts, args)


def fp8_gemm(args) -> str:
    """The FP8 engine's GEMMs on this device (``engine.fp8_gemm: auto`` resolved as the engine does)."""
    from miles_plugin_torch_engine.fp8 import scaled_mm_supported

    if args.fp8_gemm != "auto":
        return args.fp8_gemm
    return "scaled_mm" if scaled_mm_supported(torch.device(args.device)) else "dequantized"


def header(args) -> None:
    """Device, dtypes and the models' exact parameter counts (counted on the meta device: no memory)."""
    dev = args.device
    if dev == "cuda":
        cap = torch.cuda.get_device_capability()
        dev = f"cuda ({torch.cuda.get_device_name()}, capability {cap[0]}.{cap[1]})"
    print(f"device {dev}, torch {torch.__version__}; engine bfloat16; trainer float32; fp8 rows: engine "
          f"float8_e4m3fn weights (128x128 blocks), float32 activations, GEMMs {fp8_gemm(args)}")
    counts = {}
    for name, config in (("dense", dense_config(args)), ("moe", moe_config(args))):
        spec, tok = build(config, replay=False)
        with torch.device("meta"):
            counts[name] = sum(p.numel() for p in spec.build_model(tok).parameters())
    c = moe_config(args)
    print(f"shape {args.shape}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
          f"{c['num_attention_heads']} heads ({c['num_key_value_heads']} kv) of {c['head_dim']}, vocab "
          f"{c.get('vocab_size', len(tok))}; moe {args.experts} experts of {c['moe_intermediate_size']}, "
          f"top-{args.top_k}: {counts['moe']:,} parameters; dense (MLP {dense_config(args)['intermediate_size']}): "
          f"{counts['dense']:,} parameters")


def fp8_rows(prompts, args) -> None:
    """FP8 engine weights (blockwise e4m3, float32 activations) vs the float32 trainer: the dense
    model, and the MoE model (experts in FP8 too; routers stay float32) with R3 off and on. TIS
    does not change the per-token difference; it bounds the importance weight exp(logp_train -
    logp_rollout) at ``tis_cap`` in the loss: printed are the weights' spread around 1 without
    (raw ratio) and with truncation."""
    torch.manual_seed(args.seed)
    spec, tok = build(dense_config(args), replay=False)
    master = spec.build_model(tok).eval().to(args.device)
    batch = rollout(spec, tok, master, prompts, args.n, args.seed, "float32", weights="fp8", gemm=args.fp8_gemm)
    lp = plain_logprobs(master, batch)
    how = "FP8 GEMMs" if fp8_gemm(args) == "scaled_mm" else "weight-only"
    m = batch.loss_mask.bool()
    ratio = (lp - batch.rollout_logprobs).exp()[m]
    tis = ratio.clamp(max=args.tis_cap)
    print(f"fp8 engine importance weight |w - 1|: no TIS mean {float((ratio - 1).abs().mean()):.5f} "
          f"max {float((ratio - 1).abs().max()):.5f}; TIS cap {args.tis_cap}: mean "
          f"{float((tis - 1).abs().mean()):.5f} max {float((tis - 1).abs().max()):.5f} "
          f"(clipped {float((ratio > args.tis_cap).float().mean()):.4f})")
    report(f"dense fp8 engine ({how})", abs_diff(lp, batch))
    spec, tok, master = build_moe(args, args.seed)
    moe_rows(f"fp8 engine ({how})",
             [(spec, master, rollout(spec, tok, master, prompts, args.n, args.seed, "float32", weights="fp8",
                                     gemm=args.fp8_gemm))])


if __name__ == "__main__":
    main()
