"""One rank of a 2-rank CPU run (gloo) of the megatron trainer, started by test_parallel.py
through torch.distributed.run, with the TEST-ONLY CPU shim: Qwen2 at tensor_parallel=2 (with a
critic), Qwen3-MoE at expert_parallel=2 (so data-parallel 2), then Qwen2 at pipeline_parallel=2
and at pipeline_parallel=2 with 2 virtual stages per rank (4 layers; both with a critic), and
Qwen3-MoE with routing replay at pipeline_parallel=2 and at expert_parallel=2, Qwen3 with
trainer.precision mxfp8 at tensor_parallel=2 (``run_lowp``) and Llama in fp8 and in INT4 QAT at
pipeline_parallel=2 (``run_lowp_pp``).
Qwen2 at TP=2 and Qwen3-MoE at EP=2 x DP=2 also train a draft head for one step.
Writes what it measured to ``OUT/{tag}_rank{R}.pt`` and a checkpoint after one training step to
``OUT/ckpt_{tag}``; at TP=2 it also resumes ``OUT/ckpt_tp1``, written on one rank."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import cpu_shim  # noqa: E402
from helpers import Spec, batch, hf_logprobs  # noqa: E402


# tag: tensor, expert, pipeline, virtual pipeline sizes
DRAFT = {"qwen2": {"lr": 1e-2}, "qwen3_moe": {"lr": 1e-2}}  # cases that also train a draft head
CASES = {"qwen2": (2, 1, 1, 1), "qwen3_moe": (1, 2, 1, 1), "qwen2_pp2": (1, 1, 2, 1), "qwen2_vpp2": (1, 1, 2, 2)}
LAYERS = {"qwen2_vpp2": 4}  # two virtual stages per rank: 4 chunks of one layer


def spec(tag: str) -> Spec:
    """The tiny HF model of a case (its family, its layer count)."""
    family = tag.removesuffix("_pp2").removesuffix("_vpp2")
    return Spec(family, **({"num_hidden_layers": LAYERS[tag]} if tag in LAYERS else {}))


def main(out: str, device: str = "cpu", only: str | None = None) -> None:
    if device == "cpu":
        cpu_shim.install(pytest.MonkeyPatch())
    for tag, sizes in CASES.items():
        if only in (None, tag):
            run(out, tag, *sizes, device=device)
    for tag, sizes in R3_CASES.items():
        if only in (None, tag):
            run_r3(out, tag, *sizes, device=device)
    if only in (None, "lowp_tp2"):
        run_lowp(out, device=device)
    for tag, over in LOWP_PP.items():
        if only in (None, tag):
            run_lowp_pp(out, tag, over, device=device)


def run_lowp(out: str, device: str = "cpu") -> None:
    """Qwen3 (head_dim 16: every shard splits on 32-element MX blocks) with trainer.precision mxfp8 at
    tensor_parallel=2: log-probs against the HF model with libs/lowp's rounding, before and after
    two steps, and the first step's loss, gradient norm and full (TP-gathered) gradients; a strided
    gradient through the input's all-reduce; fp8 at TP=2 (64-row shards of 128-row blocks) is refused."""
    import torch.distributed as dist
    from miles import MilesError
    from miles_lowp.linear import convert
    from miles_plugin_megatron.config import MegatronConfig
    from miles_plugin_megatron.tp_train import copy_to_tp_region
    from tp2_worker import step_with_grads

    cfg = MegatronConfig(device=device, precision="mxfp8", tensor_parallel=2, lr=1e-3, grad_clip=None)
    tr = make(cfg, "qwen3")
    b = batch(rows=5)
    hf = spec("qwen3").build_model(None).eval()
    convert(hf, "mxfp8")
    res = {}
    for when in ("before", "after"):
        hf.load_state_dict({k: v.cpu() for k, v in tr.named_weights()})
        plain = spec("qwen3").build_model(None).eval()
        plain.load_state_dict(hf.state_dict())
        res[when] = (tr.logprobs(b), hf_logprobs(hf, b), hf_logprobs(plain, b), b.loss_mask)
        if when == "before":
            m, grads = step_with_grads(tr, b)
            res.update(grad_norm=m["grad_norm"], grads=grads if dist.get_rank() == 0 else None)
            res["loss"] = [m["loss"], tr.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))["loss"]]
    # the identity before a column-parallel GEMM sums a strided input gradient too (a transpose's)
    x = torch.zeros(3, 4, requires_grad=True)
    (copy_to_tp_region(x, tr.ps.get_tensor_model_parallel_group()).t() * (1.0 + tr.rank)).sum().backward()
    res["strided_grad"] = x.grad
    try:
        make(MegatronConfig(device=device, precision="fp8", tensor_parallel=2), "qwen3")
        res["fp8_refused"] = ""
    except MilesError as e:
        res["fp8_refused"] = str(e)
    torch.save(res, f"{out}/lowp_tp2_rank{tr.rank}.pt")


# tag: the low-precision settings of a 2-layer Llama at pipeline_parallel=2 (one layer per stage)
LOWP_PP = {"lowp_pp2_fp8": {"precision": "fp8"}, "lowp_pp2_int4": {"precision": "fp32", "qat": "int4"}}


def lowp_pp_config(over: dict, pp: int, device: str = "cpu"):
    """A ``LOWP_PP`` case's config at ``pp`` stages: the same micro-batches either way, since fp8's
    weight gradient rounds the tokens of a micro-batch in blocks."""
    from miles_plugin_megatron.config import MegatronConfig

    return MegatronConfig(device=device, pipeline_parallel=pp, micro_batch_size=2, lr=1e-3, grad_clip=None, **over)


def run_lowp_pp(out: str, tag: str, over: dict, device: str = "cpu") -> None:
    """A 2-layer Llama in fp8 or INT4 QAT at pipeline_parallel=2: this stage's low-precision linears,
    the log-probs (and the HF model's in full precision, which the rounding moves them from), one
    step's loss and gradient norm, and the log-probs after it."""
    from miles_plugin_megatron import lowp

    tr = make(lowp_pp_config(over, 2, device), "llama")
    b = batch(rows=5)
    hf = spec("llama").build_model(None).eval()
    hf.load_state_dict({k: v.cpu() for k, v in tr.named_weights()})
    linears = [n for n, m in tr.model.named_modules()
               if getattr(getattr(m, "_forward_impl", None), "func", None) is lowp._impl]
    res = {"lp": tr.logprobs(b), "plain": hf_logprobs(hf, b), "mask": b.loss_mask, "lowp_linears": linears}
    m = tr.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))
    res.update(loss=m["loss"], grad_norm=m["grad_norm"], after=tr.logprobs(b))
    torch.save(res, f"{out}/{tag}_rank{tr.rank}.pt")


R3_CASES = {"r3_pp2": (2, 1), "r3_ep2": (1, 2)}  # tag: pipeline, expert parallel sizes


def run_r3(out: str, tag: str, pp: int, ep: int, device: str = "cpu") -> None:
    """Qwen3-MoE with rollout routing replay at pipeline_parallel=2 (each stage's routers replay
    their own layers' records: megatron-core numbers layers across stages) or at expert_parallel=2
    x data-parallel 2 (each rank replays its own rows' records before the token all-gather)."""
    from miles_plugin_megatron.config import MegatronConfig
    from miles_plugin_megatron.trainer import MegatronTrainer
    from replay_helpers import Tok, r3_spec, record

    spec = r3_spec()
    cfg = MegatronConfig(device=device, precision="fp32", pipeline_parallel=pp, expert_parallel=ep,
                         micro_batch_size=2 if pp > 1 else None)
    tr = MegatronTrainer(cfg, spec=spec, tokenizer=Tok(), seed=0, total_steps=10)
    b = batch(rows=5)
    record(b, skip=(1,))
    hf = spec.build_model(Tok()).eval()
    hf.load_state_dict({k: v.cpu() for k, v in tr.named_weights()})
    with torch.no_grad():
        want = spec.action_logprobs(hf, b)  # the fsdp2 path: the spec's replaying forward
    torch.save({"lp": tr.logprobs(b), "want": want, "plain": hf_logprobs(hf, b), "mask": b.loss_mask},
               f"{out}/{tag}_rank{tr.rank}.pt")


def run(out: str, tag: str, tp: int, ep: int, pp: int, vp: int, device: str = "cpu") -> None:
    from miles_plugin_megatron.config import MegatronConfig

    cfg = MegatronConfig(device=device, precision="fp32", tensor_parallel=tp, expert_parallel=ep,
                         pipeline_parallel=pp, virtual_pipeline_parallel=vp,
                         micro_batch_size=2 if pp > 1 else None, lr=1e-3, grad_clip=None)
    tr = make(cfg, tag, critic=tag.startswith("qwen2"))
    b = batch(rows=5)
    hf = spec(tag).build_model(None).eval()
    torch.manual_seed(0)
    init = spec(tag).build_model(None).state_dict()  # the seed-0 weights every rank started from
    exported = {k: v.cpu() for k, v in tr.named_weights()}
    hf.load_state_dict(exported)
    res = {"export_equal": all(torch.equal(exported[k], v) for k, v in init.items()) and set(exported) == set(init),
           "lp_diff": float(((tr.logprobs(b) - hf_logprobs(hf, b)) * b.loss_mask).abs().max()),
           "local_qkv_rows": next(v.shape[0] for k, v in tr.model.state_dict().items()
                                  if k.endswith("layers.0.self_attention.linear_qkv.weight"))}
    m = tr.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))
    res.update(loss=m["loss"], grad_norm=m["grad_norm"], after=tr.logprobs(b),
               weights={k: v.cpu() for k, v in tr.named_weights()})
    res["local_names"] = sorted(tr.model.state_dict())
    if tag.startswith("qwen2"):  # the critic (TP=2, PP=2, virtual stages): values, one step, values again
        res["values"] = critic_step(tr, b)
        res["values_after"] = tr.values(b)
    tr.save(f"{out}/ckpt_{tag}")
    if tag in DRAFT:  # the draft head: TP ranks train replicas on the same data, DP ranks sum its gradients
        d = drafting(cfg, tag)
        res["draft"] = d.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))["draft_loss"]
        res["draft_head"] = {k: v.clone() for k, v in d.draft.head.state_dict().items()}
    if tag == "qwen2" and Path(f"{out}/ckpt_tp1").exists():  # a checkpoint written on one rank, at TP=2
        again = make(cfg, tag, seed=3)
        again.load(f"{out}/ckpt_tp1")
        res["from_tp1"] = again.logprobs(b)
    torch.save(res, f"{out}/{tag}_rank{tr.rank}.pt")


def make(cfg, tag: str, seed: int = 0, critic: bool = False, draft: dict | None = None):
    """A trainer of a case's model as a run makes it (with a critic: as for an algorithm that needs
    one; ``draft``: a draft: section)."""
    from types import SimpleNamespace

    from miles_plugin_megatron import _make

    algo = SimpleNamespace(needs_critic=critic, critic_lr=1e-2, value_loss=value_mse, uses_rollout=True)
    return _make(cfg, spec=spec(tag), tokenizer=None, seed=seed, total_steps=10, algorithm=algo, draft=draft)


def drafting(cfg, tag: str):
    """A trainer of a case's model with a draft head moved off its start (which guesses a random
    policy's flat distributions almost exactly), the same on every rank."""
    tr = make(cfg, tag, draft=DRAFT[tag])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        tr.draft.head.fc.weight.add_(0.3 * torch.randn(tr.draft.head.fc.weight.shape, generator=g))
    return tr


def critic_step(tr, b) -> torch.Tensor:
    """A random value head (the same on every rank), its values, then one critic step."""
    tr.build_critic()
    torch.manual_seed(5)
    with torch.no_grad():
        tr.critic.head.weight.normal_()
    values = tr.values(b)
    b.extras["returns"] = torch.ones_like(b.loss_mask)
    tr.train_critic(b, value_mse)
    return values


def value_mse(mb, v):
    return ((v - mb.extras["returns"]) ** 2 * mb.loss_mask).sum() / mb.global_tokens, {}


if __name__ == "__main__":  # OUT [DEVICE [TAG]]
    main(*sys.argv[1:])
