"""On a CUDA GPU (``pytest -m gpu``): the draft head trained by the megatron trainer beside the bf16
compute copy (its loss falls, the policy's steps are a run's without it), its loss on fp32 weights
equal to the fsdp2 path's (the HF model's) on the GPU, and ``recipes/speculative.yaml`` with
``trainer.name=megatron`` for a few RL steps (no warm start): the engine drafts with the head the
sync sent (acceptance metrics logged), the head's metrics are logged, a rerun of the same command resumes it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Spec, batch
from miles_plugin_megatron.config import MegatronConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[4]
SHARP = {"initializer_range": 0.2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 1000}


def make(draft=None, **cfg):
    from miles_plugin_megatron.trainer import MegatronTrainer

    cfg = MegatronConfig(device="cuda", **{"lr": 1e-4, **cfg})
    return MegatronTrainer(cfg, spec=Spec("qwen2", **SHARP), tokenizer=None, seed=0, total_steps=10, draft=draft)


def loss_fn(mb, lp):
    return -mb.token_mean(lp * mb.advantages), {}


def test_head_learns_beside_the_bf16_copy_and_the_policy_is_unchanged():
    tr, plain = make({"lr": 3e-2}, precision="bf16"), make(precision="bf16")
    assert tr.compute is not None  # the bf16 copy runs the policy's forwards
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = tr.draft.head.fc.weight
        w.add_(0.3 * torch.randn(w.shape, generator=g).to(w.device))
    b = batch(rows=16, vocab=1000, response=12)
    drafts = []
    for _ in range(10):
        m, want = tr.train_step(b, loss_fn), plain.train_step(b, loss_fn)
        drafts.append(m["draft_loss"])
        assert abs(m["loss"] - want["loss"]) < 1e-6 and abs(m["grad_norm"] - want["grad_norm"]) < 1e-5
    print(f"MEASURED megatron_bf16_draft_loss first={drafts[0]:.4g} last={drafts[-1]:.4g}")
    assert drafts[-1] < 0.5 * drafts[0]
    mine = {k: v for k, v in tr.named_weights() if not k.startswith("draft_head.")}
    for k, v in plain.named_weights():
        assert (mine[k] - v).abs().max() < 1e-5, k


def test_head_loss_equals_the_hf_models_on_the_gpu():
    from miles_draft.config import DraftConfig
    from miles_draft.head import attach
    from miles_draft.train import DraftTraining

    tr = make({"lr": 3e-2}, precision="fp32")
    b = batch(rows=8, vocab=1000, response=12)
    tr.train_step(b, loss_fn)
    hf = Spec("qwen2", **SHARP).build_model(None).cuda()
    attach(hf)
    hf.load_state_dict(dict(tr.named_weights()), strict=True)
    want = DraftTraining(DraftConfig(lr=3e-2), hf).step(hf, b.to("cuda"))
    got = tr.draft.step(tr, b)
    print(f"MEASURED megatron_vs_hf_draft_loss_abs_diff = {abs(got['draft_loss'] - want['draft_loss']):.3g}")
    assert abs(got["draft_loss"] - want["draft_loss"]) < 1e-3 * max(1.0, want["draft_loss"])


def test_speculative_recipe_with_the_megatron_trainer(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "miles.cli", "train", str(ROOT / "recipes" / "speculative.yaml"),
            "trainer.name=megatron", "trainer.device=cuda", "run.warm_start=null", "run.steps=3",
            "run.eval_every=3", "run.checkpoint_every=3", f"run.out_dir={out}", "rollout.batch_size=16",
            "engine.speculative.max_batch=4096",  # 64 rows: above the CUDA auto limit, where drafting is off
            "algorithm.filter_zero_variance=false"]  # an untrained policy earns no reward: keep its steps
    subprocess.run(args, check=True, timeout=900, cwd=ROOT)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all("draft_loss" in r and "spec_accept_len" in r for r in steps), steps[-1]
    assert (out / "checkpoints" / "step_000003" / "trainer" / "metadata.json").exists()
    subprocess.run(args, check=True, timeout=900, cwd=ROOT)  # the same command: resumes (the head loads) and ends
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]  # no step repeated
