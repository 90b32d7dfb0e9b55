"""On a CUDA GPU (``pytest -m gpu``): megatron log-probs vs Hugging Face's on the same weights, a
tiny Qwen3-MoE training, the bf16 compute copy and compiled layers, the PPO critic, rollout routing
replay (R3: recorded experts in bf16, and recipes/moe_r3.yaml with this trainer), TP=2, PP=2 and
virtual stages on two GPUs, and GRPO steps of recipes/megatron_gpu.yaml (loss and weights change,
engine and trainer log-probs agree, ``miles export`` loads in transformers, a rerun resumes)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Spec, batch, hf_logprobs, read_tensors
from miles_plugin_megatron.config import MegatronConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[4]
QWEN2_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 512}


def report(name: str, value: float) -> None:
    print(f"MEASURED {name} = {value:.6g}")


def make(spec, **cfg):
    from miles_plugin_megatron.trainer import MegatronTrainer

    return MegatronTrainer(MegatronConfig(device="cuda", **cfg), spec=spec, tokenizer=None, seed=0, total_steps=10)


def test_logprobs_match_hf_qwen2_05b_shape():
    spec = Spec("qwen2", tie_word_embeddings=True, **QWEN2_05B)
    b = batch(rows=16, vocab=151936)
    tr = make(spec, precision="fp32")
    named = dict(tr.named_weights())
    hf = spec.build_model(None).cuda().eval()
    hf.load_state_dict(named)
    ref = hf_logprobs(hf, b)
    m = b.loss_mask.bool()
    fp32 = tr.logprobs(b)
    tr.cfg = tr.cfg.model_copy(update={"precision": "bf16"})
    bf16 = tr.logprobs(b)
    hf_bf16 = hf_logprobs(hf.to(torch.bfloat16), b)
    d32, d16, h16 = ((x - ref)[m].abs() for x in (fp32, bf16, hf_bf16))
    report("qwen2_05b_fp32_megatron_vs_hf_max_abs", d32.max())
    report("qwen2_05b_bf16_megatron_vs_hf_fp32_max_abs", d16.max())
    report("qwen2_05b_bf16_megatron_vs_hf_fp32_mean_abs", d16.mean())
    report("qwen2_05b_bf16_hf_vs_hf_fp32_max_abs", h16.max())
    report("qwen2_05b_bf16_megatron_vs_hf_bf16_max_abs", (bf16 - hf_bf16)[m].abs().max())
    assert d32.max() < 2e-3
    assert d16.mean() < 0.05 and d16.max() < 2 * h16.max() + 0.05


def test_tiny_qwen3_moe_matches_hf_and_trains():
    spec = Spec("qwen3_moe")
    b = batch(rows=8)
    tr = make(spec, precision="fp32", lr=1e-3)
    hf = spec.build_model(None).cuda().eval()
    hf.load_state_dict(dict(tr.named_weights()))
    diff = (tr.logprobs(b) - hf_logprobs(hf, b))[b.loss_mask.bool()].abs().max()
    report("tiny_qwen3_moe_fp32_megatron_vs_hf_max_abs", diff)
    assert diff < 1e-3
    tr.cfg = tr.cfg.model_copy(update={"precision": "bf16"})
    before = {k: v.clone() for k, v in tr.named_weights()}
    losses = [tr.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))["loss"]
              for _ in range(5)]
    report("tiny_qwen3_moe_loss_first", losses[0])
    report("tiny_qwen3_moe_loss_last", losses[-1])
    assert losses[-1] < losses[0]
    changed = [k for k, v in tr.named_weights() if not torch.equal(v, before[k])]
    assert any("experts" in k for k in changed) and any("mlp.gate" in k for k in changed)


def test_bf16_compute_copy_and_compiled_layers():
    """``precision: bf16`` from the start: the bf16 copy of the model runs (log-probs close to the
    fp32 HF model's, as autocast's were), steps lower the loss and move the fp32 weights;
    ``compile: true`` computes the same within bf16 rounding."""
    spec, b = Spec("qwen2"), batch(rows=8)
    loss_fn = lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {})  # noqa: E731
    eager, compiled = make(spec, precision="bf16", lr=1e-3), make(spec, precision="bf16", lr=1e-3, compile=True)
    assert eager.compute is not None and next(eager.policy_module().parameters()).dtype == torch.bfloat16
    hf = spec.build_model(None).cuda().eval()
    hf.load_state_dict(dict(eager.named_weights()))
    m = b.loss_mask.bool()
    lp = eager.logprobs(b)
    diff = (lp - hf_logprobs(hf, b))[m].abs()
    report("tiny_qwen2_bf16_copy_vs_hf_fp32_mean_abs", diff.mean())
    assert diff.mean() < 0.05
    gap = (compiled.logprobs(b) - lp)[m].abs()
    report("tiny_qwen2_compiled_vs_eager_bf16_max_abs", gap.max())
    assert gap.max() < 0.1
    before = {k: v.clone() for k, v in eager.named_weights()}
    losses = [[tr.train_step(b, loss_fn)["loss"] for _ in range(4)] for tr in (eager, compiled)]
    report("tiny_qwen2_bf16_copy_loss_first", losses[0][0])
    report("tiny_qwen2_bf16_copy_loss_last", losses[0][-1])
    assert losses[0][-1] < losses[0][0] and losses[1][-1] < losses[1][0]
    assert all(abs(x - y) < 0.05 * max(1.0, abs(x)) for x, y in zip(*losses))
    assert all(v.dtype == torch.float32 for _, v in eager.named_weights())  # the master weights
    assert any(not torch.equal(v, before[k]) for k, v in eager.named_weights())


def test_critic_values_match_hf_and_learn_returns():
    """PPO's critic on the GPU: fp32 values equal the HF backbone's through the same head; in bf16
    a few critic steps halve the error to fixed returns and leave the policy as it was."""
    from types import SimpleNamespace

    from miles_plugin_megatron import _make

    spec = Spec("qwen2", tie_word_embeddings=True)
    b = batch(rows=8)

    def mse(mb, v):
        return ((v - mb.extras["returns"]) ** 2 * mb.loss_mask).sum() / mb.global_tokens, {}

    algo = SimpleNamespace(needs_critic=True, critic_lr=1e-3, value_loss=mse)
    tr = _make(MegatronConfig(device="cuda", precision="fp32", lr=1e-3), spec=spec, tokenizer=None, seed=0,
               total_steps=10, algorithm=algo)
    tr.build_critic()
    torch.manual_seed(5)
    with torch.no_grad():
        tr.critic.head.weight.normal_()
    hf = spec.build_model(None).cuda().eval()
    hf.load_state_dict(dict(tr.named_weights()))
    with torch.no_grad():
        h = hf.base_model(input_ids=b.input_ids.cuda(), attention_mask=b.attention_mask.cuda(),
                          position_ids=b.position_ids.cuda()).last_hidden_state[:, b.prompt_len - 1:-1]
        want = tr.critic.head(h.float()).squeeze(-1).cpu()
    diff = ((tr.values(b) - want) * b.loss_mask).abs().max()
    report("tiny_qwen2_critic_fp32_values_vs_hf_max_abs", diff)
    assert diff < 1e-3
    tr.cfg = tr.cfg.model_copy(update={"precision": "bf16"})
    b.extras["returns"] = torch.where(b.advantages > 0, 1.0, -1.0)
    policy = tr.logprobs(b)
    errors = []
    for _ in range(10):
        errors.append(float(((tr.values(b) - b.extras["returns"]) ** 2 * b.loss_mask).sum() / b.loss_mask.sum()))
        tr.train_critic(b, mse)
    report("tiny_qwen2_critic_mse_first", errors[0])
    report("tiny_qwen2_critic_mse_last", errors[-1])
    assert errors[-1] < 0.5 * errors[0]
    assert torch.equal(tr.logprobs(b), policy)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("tag", ["qwen2", "qwen2_pp2", "qwen2_vpp2"])
def test_two_gpus_tensor_and_pipeline_parallel(tmp_path, tag):
    """TP=2, PP=2 and PP=2 with 2 virtual stages (each with the critic) over NCCL on two GPUs,
    against the same step on one GPU (the 2-rank gloo test of test_parallel.py, on GPUs: NCCL and
    batched p2p between the stages)."""
    from test_parallel import against_one_rank

    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
                    str(Path(__file__).parent / "parallel_worker.py"), str(tmp_path), "cuda", tag],
                   check=True, timeout=600)
    ranks = against_one_rank(tmp_path, tag, device="cuda")
    report(f"two_gpus_{tag}_lp_vs_hf_max_abs", max(r["lp_diff"] for r in ranks))


def test_routing_replay_uses_the_recorded_experts_in_bf16():
    """R3 on a GPU, bf16 autocast: megatron-core's routers use exactly the recorded experts, and
    the log-probs stay close to the fsdp2 path's (the moe spec's replaying HF forward, fp32)."""
    from miles_plugin_megatron.trainer import MegatronTrainer
    from replay_helpers import MOE, HFRouting, MegatronRouting, Tok, as_sets, r3_spec, record

    spec = r3_spec()
    tr = MegatronTrainer(MegatronConfig(device="cuda", precision="bf16"), spec=spec, tokenizer=Tok(), seed=0,
                         total_steps=10)
    b = batch(rows=8)
    record(b, skip=(1,))
    hooks = MegatronRouting(tr.policy_module(), len(b))  # the module that runs
    lp = tr.logprobs(b)
    hooks.close()
    E = MOE["num_experts"]
    for row, s in enumerate(b.samples):
        rec = (s.extensions.get("moe") or {}).get("routed_experts")
        for layer in range(MOE["num_hidden_layers"]):
            if rec is not None:
                assert torch.equal(hooks.maps[layer][row, :len(rec)], as_sets(rec[:, layer], E))
    hf = spec.build_model(Tok()).cuda().eval()
    hf.load_state_dict(dict(tr.named_weights()))
    h_hooks = HFRouting(hf, len(b), E)
    with torch.no_grad():
        want = spec.action_logprobs(hf, _cuda(b)).cpu()
    h_hooks.close()
    for row, s in enumerate(b.samples):
        rec = (s.extensions.get("moe") or {}).get("routed_experts")
        lead = b.prompt_len - len(s.prompt_ids)
        if rec is not None:
            assert torch.equal(h_hooks.maps[0][row, lead:lead + len(rec)], hooks.maps[0][row, :len(rec)])
    diff = (lp - want)[b.loss_mask.bool()].abs()
    report("r3_bf16_megatron_vs_fp32_fsdp2_path_max_abs", diff.max())
    report("r3_bf16_megatron_vs_fp32_fsdp2_path_mean_abs", diff.mean())
    assert diff.mean() < 0.05


def _cuda(b):
    from dataclasses import fields, replace

    return replace(b, **{f.name: getattr(b, f.name).cuda() for f in fields(b)
                         if isinstance(getattr(b, f.name), torch.Tensor)})


def test_moe_r3_recipe_with_the_megatron_trainer(tmp_path):
    """recipes/moe_r3.yaml (the moe spec with routing replay) with trainer.name=megatron, engine and
    trainer on the GPU: steps complete and the engine's log-probs stay close to the trainer's."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles.cli", "train", str(ROOT / "recipes/moe_r3.yaml"), f"run.out_dir={out}",
           "loggers=[]", "trainer.name=megatron", "trainer.device=cuda", "engine.device=cuda", "run.steps=4",
           "run.eval_every=4", "run.warm_start.max_steps=20", "run.warm_start.min_steps=20",
           "run.warm_start.eval_every=20", "env.eval_size=32", "algorithm.filter_zero_variance=false"]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "train_rollout_logprob_abs_diff" in r]
    assert [r["step"] for r in steps][-4:] == [1, 2, 3, 4]
    diffs = [r["train_rollout_logprob_abs_diff"] for r in steps[-4:]]
    report("moe_r3_megatron_logprob_abs_diff_max", max(diffs))
    assert max(diffs) < 0.05 and all(r["nonfinite_steps"] == 0 for r in steps[-4:])


def _train(out: Path, steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "miles.cli", "train", str(ROOT / "recipes/megatron_gpu.yaml"),
           "--plugin", str(Path(__file__).parent / "even_token_reward.py"), f"run.out_dir={out}",
           f"run.steps={steps}", "run.checkpoint_every=10", "run.keep_checkpoints=3"]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_recipe_trains_exports_and_resumes(tmp_path):
    out = tmp_path / "run"
    rows = [r for r in _train(out, 20) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 21))
    losses = [r["loss"] for r in rows]
    rewards = [r["reward_mean"] for r in rows]
    report("grpo_reward_mean_first5", sum(rewards[:5]) / 5)
    report("grpo_reward_mean_last5", sum(rewards[-5:]) / 5)
    diffs = [r["train_rollout_logprob_abs_diff"] for r in rows if "train_rollout_logprob_abs_diff" in r]
    for k, v in (("loss_first", losses[0]), ("loss_last", losses[-1]), ("grad_norm_mean",
                 sum(r["grad_norm"] for r in rows) / len(rows)), ("logprob_abs_diff_max", max(diffs)),
                 ("logprob_abs_diff_mean", sum(diffs) / len(diffs))):
        report(f"grpo_{k}", v)
    assert len(set(losses)) > 1 and diffs and max(diffs) < 0.05
    ck = sorted((out / "checkpoints").glob("step_*"))
    w10, w20 = (read_tensors(str(c / "trainer")) for c in ck[-2:])  # dist_checkpointing folders
    moved = max(float((w20[k] - w10[k]).abs().max()) for k in w10)
    report("grpo_weights_max_abs_change_step10_to_20", moved)
    assert moved > 0
    subprocess.run([sys.executable, "-m", "miles.cli", "export", str(out), "--to", str(tmp_path / "hf")],
                   check=True, cwd=ROOT, timeout=600)
    from transformers import AutoModelForCausalLM

    # use_kernels=False: transformers otherwise fetches hub kernels, which an offline machine cannot
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, use_kernels=False)
    sd = hf.state_dict()
    emb = w20["embedding.word_embeddings.weight"][:sd["model.embed_tokens.weight"].shape[0]]
    assert torch.equal(sd["model.embed_tokens.weight"], emb)
    again = [r for r in _train(out, 22) if "loss" in r]
    assert [r["step"] for r in again] == list(range(1, 23))  # resumed at 21: nothing repeated or lost
