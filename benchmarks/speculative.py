"""Speculative decoding: no draft, a frozen draft head and one trained online, over an RL run.

Runs a recipe (a supervised warm start, then GRPO, during which the policy drifts from what the
warm start taught it) three times with the same seed, tasks and token budget: without
speculation, with the draft head frozen after the warm start (``draft.train=false``; the head
learns only on the warm start's demonstrations) and with the head trained on every step's
rollouts (``draft.train=true``). Printed per quarter of the run: rollout tokens/s, the mean
acceptance length (tokens a row gains per verify step, the bonus token included) and the mean
response length, then online / frozen in the last quarter. ``--recipe arith`` (default):
``recipes/speculative.yaml``, 3-digit sums, a policy that drifts little. ``--recipe tool_use``:
``recipes/tool_use.yaml`` with a draft head added, where RL turns direct answers (``=56000``)
into multi-turn calculator calls (``<tool_call>...</tool_call>``, the tool's output, ``=64467``):
the format a frozen head learned at the warm start is mostly not what the policy writes later.

``--decode``: the engine alone, decode tokens/s with and without speculation at batch 1, 8, 64
and 256 (greedy, or ``--temperature``, ``--new-tokens`` each), with a head first trained on the model's own greedy
continuations; ``--device cuda`` runs the 0.5B (Qwen2-0.5B) shape there. ``--decode --mtp``: the
same for the ``mtp`` draft on the model's own forward, a DeepSeek-V3-shaped model (MLA, MoE) whose
MTP layer is first trained (``miles_mtp.train``) on its own greedy continuations. A random model's
text is hard to predict; ``--text-steps N`` first trains the target N steps on Python's standard
library source (byte-level), so the draft predicts a trained model's text, and prints a sample.
``--draft-vocab N``: the head scores only the N most frequent tokens of its training data
(``draft.vocab``, EAGLE-3's reduced draft vocabulary).

    python benchmarks/speculative.py [--recipe arith|tool_use] [--steps N] [--warm-start N] [--quick]
                                     [--out runs/bench_spec] [--max-batch 4096] [--kinds none frozen online]
    python benchmarks/speculative.py --decode [--mtp] [--device cpu|cuda] [--new-tokens 64] [--tokens 3]
                                     [--text-steps 400] [--temperature 0] [--draft-vocab N]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"none": ["engine.speculative=null", "draft=null"],
         "frozen": ["draft.train=false"],
         "online": ["draft.train=true"]}
# recipe file and the overrides that give it a draft head (the none arm drops both)
RECIPES = {"arith": ("recipes/speculative.yaml", []),
           "tool_use": ("recipes/tool_use.yaml", ["engine.speculative={draft: head, tokens: 3}", "draft={lr: 1.0e-3}"])}
QUICK = ["run.warm_start.max_steps=10", "run.warm_start.min_steps=10", "run.warm_start.batch_size=32",
         "run.eval_every=1000", "env.eval_size=40", "rollout.batch_size=8", "run.threads=1"]


def run_kind(kind: str, args) -> list[dict]:
    out = Path(args.out) / kind
    shutil.rmtree(out, ignore_errors=True)
    recipe, draft = RECIPES[args.recipe]
    cmd = [sys.executable, "-m", "miles.cli", "train", str(ROOT / recipe), f"run.out_dir={out}", *draft,
           *([f"run.steps={args.steps}"] if args.steps else []), f"engine.speculative.max_batch={args.max_batch}",
           "loggers=[]", *KINDS[kind], *(QUICK if args.quick else []),
           *([f"run.threads={args.threads}"] if args.threads else []),
           *([f"draft.lr={args.draft_lr}"] if args.draft_lr and kind != "none" else []), *args.set,
           *([f"run.warm_start.max_steps={args.warm_start}", f"run.warm_start.min_steps={args.warm_start}"]
             if args.warm_start else [])]
    if kind == "none":
        cmd = [c for c in cmd if not c.startswith("engine.speculative.max_batch")]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def quarters(rows: list[dict], key: str) -> list[float | None]:
    steps = [r for r in rows if r["step"] > 0 and key in r]
    if not steps:
        return [None] * 4
    q = [steps[i * len(steps) // 4:(i + 1) * len(steps) // 4] or steps for i in range(4)]
    return [sum(r[key] for r in part) / len(part) for part in q]


def run_table(args) -> dict:
    table = {}
    timed = lambda kind: (time.perf_counter(), run_kind(kind, args), time.perf_counter())  # noqa: E731
    if args.parallel:  # the arms side by side: whatever else loads the host slows each alike
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(args.kinds)) as pool:
            runs = dict(zip(args.kinds, pool.map(timed, args.kinds)))
    else:
        runs = {kind: timed(kind) for kind in args.kinds}
    for kind, (t0, rows, t1) in runs.items():
        evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
        table[kind] = {"tok_s": quarters(rows, "tokens_per_second"), "accept": quarters(rows, "spec_accept_len"),
                       "length": quarters(rows, "response_length_mean"),
                       "eval": (evals[0], evals[-1]), "seconds": t1 - t0}
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"{'draft':8} {'rollout tok/s per quarter':>40}   {'accept len per quarter':>28}   "
          f"{'response len per quarter':>28}   eval acc")
    for kind, t in table.items():
        print(f"{kind:8} " + " ".join(f"{fmt(v, ',.0f'):>9}" for v in t["tok_s"]) + "   "
              + " ".join(f"{fmt(v, '.2f'):>6}" for v in t["accept"]) + "   "
              + " ".join(f"{fmt(v, '.1f'):>6}" for v in t["length"])
              + f"   {t['eval'][0]:.3f} -> {t['eval'][1]:.3f}")
    if not {"frozen", "online"} <= table.keys():
        return table
    on, fr = table["online"], table["frozen"]
    none = f"; speculation / none {on['tok_s'][3] / table['none']['tok_s'][3]:.2f}x" if "none" in table else ""
    print(f"last quarter online / frozen: tokens/s {on['tok_s'][3] / fr['tok_s'][3]:.2f}x, "
          f"acceptance length {on['accept'][3] / fr['accept'][3]:.2f}x{none}")
    return table


SHAPES = {"cpu": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64),
          "cuda": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936)}


MTP_SHAPES = {"cpu": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
                          qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, vocab_size=64),
              "cuda": dict(hidden_size=1024, intermediate_size=4096, moe_intermediate_size=512, num_hidden_layers=12,
                           num_attention_heads=16, kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=32,
                           qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=32, vocab_size=32000)}


def mtp_model(args):
    """A DeepSeek-V3-shaped model with one MTP layer (the arch plugin attaches it) and its spec."""
    import torch
    from miles import make_plugin_manager
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = make_plugin_manager().create("architectures", "deepseek_v3", None)
    shape = MTP_SHAPES[args.device]
    cfg = AutoConfig.for_model("deepseek_v3", **shape, num_key_value_heads=shape["num_attention_heads"],
                               first_k_dense_replace=1, n_group=1, topk_group=1, num_experts_per_tok=2,
                               num_nextn_predict_layers=1, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    (layer,) = arch.attach_mtp(model, None)
    with torch.no_grad():  # DeepSeek-V3's checkpoints hold copies of the model's embedding and head there
        layer.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        layer.shared_head.head.weight.copy_(model.lm_head.weight)
    model = model.to(args.device)

    class Spec:
        def architecture(self):
            return arch

        def build_model(self, tokenizer):
            return model

    return model, Spec()


def decode_table(args) -> None:
    import torch
    from miles import Batch, SamplingParams, Sample, Task
    from miles_draft.config import DraftConfig
    from miles_draft.train import DraftTraining
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    class Spec:
        def build_model(self, tokenizer):
            return model

    class Tok:
        eos_token_id, pad_token_id = None, 0

    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.mtp:
        model, spec_ = mtp_model(args)
        cfg = model.config
    else:
        shape = {**SHAPES[args.device], **({"vocab_size": max(257, SHAPES[args.device]["vocab_size"])}
                                           if args.text_steps else {})}
        cfg = Qwen2Config(**shape, max_position_embeddings=512, tie_word_embeddings=True)
        model, spec_ = Qwen2ForCausalLM(cfg).to(args.device), Spec()
    base = {"device": args.device, "dtype": "bfloat16" if dtype == torch.bfloat16 else "float32"}
    plain = TorchEngine(TorchEngineConfig.model_validate(base), spec=spec_, tokenizer=Tok())
    draft = "mtp" if args.mtp else "head"
    params = SamplingParams(args.temperature, 1.0, 0, args.new_tokens, [])
    teach = SamplingParams(0.0, 1.0, 0, args.train_tokens or args.new_tokens, [])
    g = torch.Generator().manual_seed(1)
    prompt = lambda: torch.randint(1, cfg.vocab_size, (8,), generator=g).tolist()  # noqa: E731
    if args.text_steps:  # a trained target: its text, and so its draft's acceptance, is a trained model's
        held_out = train_on_text(model, args)
        prompt = lambda: text_ids(held_out, int(torch.randint(len(held_out) - 32, (1,), generator=g)), 32)  # noqa: E731
    # the head learns the model's own greedy continuations (a random model's text is its policy)
    if args.mtp:  # the engine holds the model itself (Spec returns it): the layer it drafts with learns
        from miles_mtp.train import MTPTraining

        train = MTPTraining(DraftConfig(lr=args.head_lr), plain.model)
    else:
        train = DraftTraining(DraftConfig(lr=args.head_lr, vocab=args.draft_vocab), model)
    for step in range(args.head_steps):
        prompts = [prompt() for _ in range(args.head_batch)]
        comps = plain.generate(prompts, teach, n=1)
        samples = [Sample(task=Task(prompt=""), prompt_ids=p, response_ids=c[0].token_ids,
                          loss_mask=[1] * len(c[0].token_ids)) for p, c in zip(prompts, comps)]
        with torch.enable_grad():
            metrics = train.step(plain.model if args.mtp else model, Batch.from_samples(samples, 0).to(args.device))
        if step % 100 == 99:
            print(f"  step {step + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()), flush=True)
    loss = metrics.get("mtp_loss" if args.mtp else "draft_loss", 0)
    cover = f", vocabulary cover {metrics['draft_vocab_cover']:.3f}" if "draft_vocab_cover" in metrics else ""
    print(f"{draft} trained {args.head_steps} steps: loss {loss:.3f}{cover}")
    if args.text_steps:  # what the target writes, to judge the acceptance by
        first = prompt()
        out = plain.generate([first], params, n=1)[0][0].token_ids
        print("sample: " + repr(bytes(t - 1 for t in first + out if 0 < t <= 256).decode(errors="replace")))
    for k in args.tokens:  # one trained draft, a table per number of draft tokens
        spec = TorchEngine(TorchEngineConfig.model_validate({**base, "speculative": {
            "draft": draft, "tokens": k, "max_batch": 1 << 20}}), spec=spec_, tokenizer=Tok())
        auto = TorchEngine(TorchEngineConfig.model_validate({**base, "speculative": {
            "draft": draft, "tokens": k}}), spec=spec_, tokenizer=Tok())
        print(f"k = {k}")
        print(f"{'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speed-up':>9} {'accept len':>11} {'auto':>6}")
        for b in args.batches:
            prompts = [prompt() for _ in range(b)]
            timed = {name: tokens_per_s(engine, prompts, params, args)
                     for name, engine in (("plain", plain), ("spec", spec), ("auto", auto))}
            accept = spec.step_metrics().get("spec_accept_len", 0.0)
            print(f"{b:>5} {timed['plain']:>12,.0f} {timed['spec']:>11,.0f} {timed['spec'] / timed['plain']:>8.2f}x "
                  f"{accept:>11.2f} {timed['auto'] / timed['plain']:>5.2f}x")
        if args.profile and args.device == "cuda":
            profile_steps(plain, spec, [prompt() for _ in range(args.batches[0])], params)
        del spec, auto


def text_ids(data: bytes, start: int, n: int) -> list[int]:
    """Byte-level token ids (byte + 1; id 0 is padding) of ``data[start:start + n]``."""
    return [b + 1 for b in data[start:start + n]]


def train_on_text(model, args) -> bytes:
    """Train ``model`` from its random init ``--text-steps`` steps of next-byte prediction (AdamW,
    bf16 autocast on CUDA, 16 x 256 bytes a step) on the top-level modules of Python's standard
    library, a real text every machine running this has; returns the held-out tenth the prompts
    come from."""
    import sysconfig

    import torch

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = b"\n".join(p.read_bytes() for p in files)
    cut = len(data) * 9 // 10
    train, held_out = data[:cut], data[cut:]
    opt = torch.optim.AdamW(model.parameters(), lr=args.text_lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, args.text_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    g = torch.Generator().manual_seed(2)
    model.train()
    for step in range(args.text_steps):
        starts = torch.randint(len(train) - 257, (16,), generator=g).tolist()
        ids = torch.tensor([text_ids(train, s, 257) for s in starts], device=args.device)
        with torch.autocast("cuda", torch.bfloat16, enabled=args.device == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        if step % 100 == 99 or step == args.text_steps - 1:
            print(f"  text step {step + 1}: loss {loss.item():.3f} nats/byte", flush=True)
    model.eval()
    del opt
    print(f"target trained {args.text_steps} steps on {len(train) / 1e6:.1f} MB of Python source")
    return held_out


def tokens_per_s(engine, prompts: list, params, args) -> float:
    """The median of ``args.repeats`` timed generate calls after a warm-up (caches, graphs)."""
    import torch

    engine.generate(prompts, params, n=1)
    engine.step_metrics()
    times = []
    for _ in range(args.repeats):  # the median: other processes share the cores
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, params, n=1)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return len(prompts) * args.new_tokens / sorted(times)[len(times) // 2]


def profile_steps(plain, spec, prompts: list, params) -> None:
    """The GPU kernels of one generate call, plain and speculative: where a speculative step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    for name, engine in (("plain", plain), ("spec", spec)):
        engine.generate(prompts, params, n=1)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params, n=1)
        print(f"-- {name}, {len(prompts)} rows: GPU kernels")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="arith", choices=sorted(RECIPES), help="arith: recipes/speculative.yaml; "
                    "tool_use: recipes/tool_use.yaml with a draft head (a policy that drifts far)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the recipe's)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS), help="the arms to run")
    ap.add_argument("--quick", action="store_true", help="a 10-step warm start, 8 prompts a step, one thread (tests)")
    ap.add_argument("--out", default="runs/bench_spec")
    ap.add_argument("--warm-start", type=int, default=None, help="warm-start steps (default: the recipe's)")
    ap.add_argument("--threads", type=int, default=None, help="run.threads of each arm (default: the recipe's)")
    ap.add_argument("--draft-lr", type=float, default=None, help="draft.lr, the head's (warm start and online)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every arm "
                    "(e.g. env.teacher_tool_rate=0.1)")
    ap.add_argument("--max-batch", default="4096", help="engine.speculative.max_batch of the drafted runs")
    ap.add_argument("--parallel", action="store_true", help="run the arms at the same time (one process each)")
    ap.add_argument("--decode", action="store_true", help="the engine's decode speed-up per batch size")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--train-tokens", type=int, default=None, help="--decode: tokens of each continuation the "
                    "head learns from (default: --new-tokens)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[3], help="draft tokens per step (--decode: several)")
    ap.add_argument("--profile", action="store_true", help="--decode on CUDA: one call's kernels, first batch")
    ap.add_argument("--head-steps", type=int, default=150)
    ap.add_argument("--head-lr", type=float, default=2e-3, help="--decode: the draft's learning rate")
    ap.add_argument("--head-batch", type=int, default=32, help="--decode: the head's training prompts per step")
    ap.add_argument("--text-steps", type=int, default=0, help="--decode: first train the target this many steps "
                    "on Python's standard library source (byte-level); prompts are held-out source")
    ap.add_argument("--text-lr", type=float, default=6e-4, help="--decode: the target's learning rate on that text")
    ap.add_argument("--temperature", type=float, default=0.0, help="--decode: the timed calls' sampling "
                    "temperature (0: greedy)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mtp", action="store_true", help="--decode with the mtp draft (a DeepSeek-V3 shape)")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N", help="--decode: the head's reduced "
                    "draft vocabulary (draft.vocab: the N most frequent tokens of its training continuations)")
    args = ap.parse_args()
    if args.draft_vocab is not None and (args.mtp or not args.decode):
        ap.error("--draft-vocab applies to --decode with the draft head")
    if args.decode:
        decode_table(args)
    else:
        run_table(args)


if __name__ == "__main__":
    main()
