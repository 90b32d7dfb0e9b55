"""2 ranks (FSDP2, gloo on CPU) against 1 rank on the same global batches.

This file is also the rank script: ``python test_multirank.py '{"scenario": ..., "out": ...}'``
runs one scenario under the env the launcher sets and writes each rank's results to
``out/rank<r>.pt``. The 1-rank side runs in the pytest process itself.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from miles import Batch, MilesError, Sample, Task
from miles.testing import TinySpec, char_tokenizer
from miles_telemetry import untimed

# 45 tokens: an odd vocabulary, so the embedding's shards are uneven (23 + 22 rows)
CHARS = "0123456789+-*=() abcdefghijklmnopqrstuvwxy"
SETTINGS = dict(lr=1e-2, micro_batch_size=3, grad_clip=1.0, warmup_steps=1, schedule="cosine")


def make_trainer(**kw):
    from miles_plugin_fsdp2.config import FSDP2Config
    from miles_plugin_fsdp2.trainer import FSDP2Trainer

    return FSDP2Trainer(FSDP2Config(**{**SETTINGS, **kw}), spec=TinySpec(hidden=64, layers=2),
                        tokenizer=char_tokenizer(CHARS), seed=0, total_steps=6)


def batches() -> list[Batch]:
    """Step 1: 3 groups of 4 (a rank boundary falls inside a group); step 2: 7 distinct prompts,
    temperature 0.7 (one rank has a micro-batch fewer); step 3: a single row (one rank idle)."""
    g = torch.Generator().manual_seed(1)

    def rand(lo, hi):
        return torch.randint(3, 20, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    def sample(p):
        r = rand(1, 5)
        return Sample(Task("x"), prompt_ids=p, response_ids=r, logprobs=[-1.0] * len(r))

    grouped = [sample(p) for p in (rand(2, 6) for _ in range(3)) for _ in range(4)]
    distinct = [sample(rand(2, 6)) for _ in range(7)]
    out = []
    for samples in (grouped, distinct, distinct[:1]):
        adv = [float(torch.randn(1, generator=g)) for _ in samples]
        out.append(Batch.from_samples(samples, pad_id=0, advantages=adv))
    out[1].temperature = 0.7
    return out


def loss_fn(batch, logprobs):
    # a token-mean and a sequence-mean term: both global denominators must be honoured
    loss = batch.token_mean(-batch.advantages * logprobs) + 0.1 * batch.seq_mean(-logprobs)
    return loss, {"adv_mean": float(batch.advantages[:, 0].mean())}


def run_steps(t, steps, ckpt: str | None = None) -> dict:
    """Train on ``batches()[steps]``, saving to ``ckpt`` after step 2; record what tests compare."""
    bs, out = batches(), {"metrics": [], "seconds": []}
    for i in steps:
        t0 = time.perf_counter()
        out["metrics"].append(t.train_step(bs[i], loss_fn))
        out["seconds"].append(time.perf_counter() - t0)
        if ckpt and i == 1:
            t.save(ckpt)
    out["weights"] = {k: v.clone() for k, v in t.named_weights()}
    out["logprobs"] = [t.logprobs(b) for b in bs]
    return out


def scenario_train(ckpt: str | None = None, **kw) -> dict:
    t = make_trainer(**kw)
    t.snapshot_reference()
    bs = batches()
    t0 = time.perf_counter()
    before = [t.logprobs(b) for b in bs]
    res = {"logprobs_before": before, "logprobs_seconds": time.perf_counter() - t0,
           "rank": t.rank, "world_size": t.world_size}
    res.update(run_steps(t, range(3), ckpt))
    res["ref_logprobs"] = [t.logprobs(b, "ref") for b in bs]
    return res


def scenario_resume(ckpt: str, **kw) -> dict:
    t = make_trainer(**kw)
    t.load(ckpt)
    res = run_steps(t, [2])
    res["ref_logprobs"] = [t.logprobs(b, "ref") for b in batches()]
    return res


def scenario_load_weights(**kw) -> dict:
    """New full weights (the same on every rank) streamed into a sharded trainer, then read back."""
    g, src = torch.Generator().manual_seed(7), {}
    for k, v in make_trainer().named_weights():
        src[k] = v + 0.01 * torch.randn(v.shape, generator=g)
        if k == "lm_head.weight":  # tied to the embedding: one tensor under two names
            src[k] = src["model.embed_tokens.weight"]
    t = make_trainer(**kw)
    t.load_weights(src.items())
    return {"src": src, "weights": dict(t.named_weights()), "logprobs": [t.logprobs(b) for b in batches()]}


def main(opts: dict) -> None:
    """Rank script entry (a fresh interpreter per rank): one scenario, results to a file."""
    torch.set_num_threads(1)
    name, out = opts.pop("scenario"), opts.pop("out")
    if name == "every":
        return every_scenario(out)
    scenario = {"train": scenario_train, "resume": scenario_resume}[name]
    torch.save(scenario(**opts), os.path.join(out, f"rank{os.environ['RANK']}.pt"))


def launch_two(tmp, scenario: str, dest=None, **opts) -> list[dict]:
    """Run ``scenario`` in 2 ranks; each writes ``rank<r>.pt`` to ``dest`` (``tmp/scenario``)."""
    from miles_plugin_fsdp2.testing import launch

    out = dest or tmp / scenario
    out.mkdir(parents=True, exist_ok=True)
    launch([__file__, json.dumps({"scenario": scenario, "out": str(out), **opts})], world_size=2,
           timeout=300, env={"OMP_NUM_THREADS": "1"})
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def every_scenario(out: str) -> None:
    """One rank: train (saving a checkpoint), then two more trainers in the same process (the loop
    does that too): resume from the 1-rank checkpoint, stream weights in."""
    tmp = Path(out)
    res = {"train": scenario_train(ckpt=str(tmp / "ckpt_w2")),
           "resume": scenario_resume(ckpt=str(tmp / "ckpt_w1")),
           "load_weights": scenario_load_weights(), "gather": scenario_gather()}
    torch.save(res, tmp / f"rank{os.environ['RANK']}.pt")


def scenario_gather() -> dict:
    """Row-sharded DTensors of uneven row counts (rank 1 holding fewer rows or none), mixed
    dtypes and a plain tensor, gathered several per collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from miles_plugin_fsdp2.dist import full_tensors

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(3)
    full = {"a": torch.randn(5, 3, generator=g), "b": torch.randn(1, 4, generator=g),
            "c": torch.randn(7, generator=g), "d": torch.arange(6).view(3, 2),
            "e": torch.randn(2, 2, generator=g), "plain": torch.randn(3, generator=g)}
    named = [(k, v if k == "plain" else distribute_tensor(v, mesh, [Shard(0)])) for k, v in full.items()]
    return {"want": full, "got": dict(full_tensors(named, limit=64))}


# A key-projection bias has an exactly zero gradient (softmax ignores a shift shared by all keys),
# so what reaches it is rounding noise, which Adam scales up to lr-sized steps: rank count and
# summation order change that noise. It gets a looser bound, a fraction of one step (lr 1e-2).
NOISE_ONLY = ("k_proj.bias",)


def assert_weights_close(a: dict, b: dict, atol: float, what: str, noise_atol: float = 3e-4) -> float:
    """Every tensor within ``atol``; returns the largest difference outside ``NOISE_ONLY``."""
    assert list(a) == list(b), f"{what}: different weight names"
    worst = 0.0
    for k in a:
        tol = max(atol, noise_atol) if k.endswith(NOISE_ONLY) else atol
        torch.testing.assert_close(a[k].cpu(), b[k].cpu(), rtol=0, atol=tol, msg=lambda m, k=k: f"{what} {k}: {m}")
        if not k.endswith(NOISE_ONLY):
            worst = max(worst, float((a[k].cpu().float() - b[k].cpu().float()).abs().max()))
    return worst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 1-rank run (in this process, saving a checkpoint after step 2), then every 2-rank
    scenario in 2 fresh interpreters (forking the test worker, which has threads, can crash)."""
    tmp = tmp_path_factory.mktemp("multirank")
    one = scenario_train(ckpt=str(tmp / "ckpt_w1"))
    two = launch_two(tmp, "every", dest=tmp)
    return {"tmp": tmp, "one": one, **{k: [t[k] for t in two] for k in two[0]}}


def test_two_rank_steps_match_one_rank(runs):
    one, (r0, r1) = runs["one"], runs["train"]
    assert (r0["rank"], r0["world_size"], r1["rank"]) == (0, 2, 1)
    for step, abc in enumerate(zip(one["metrics"], r0["metrics"], r1["metrics"]), 1):
        a, b, c = (untimed(m) for m in abc)
        assert b == c, f"step {step}: ranks report different metrics"
        assert set(a) == set(b)
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), f"step {step} {k}"
    worst = assert_weights_close(one["weights"], r0["weights"], 2e-5, "2 ranks vs 1")
    assert_weights_close(r0["weights"], r1["weights"], 0, "rank 0 vs rank 1")
    moved = max(float((w - s).abs().max()) for w, s in zip(one["weights"].values(), scenario_weights0()))
    assert moved > 100 * max(worst, 1e-7)  # the steps did move the weights, far beyond the gap
    print(f"\nmax |w2 - w1| {worst:.2e}; loss diffs "
          f"{[abs(a['loss'] - b['loss']) for a, b in zip(one['metrics'], r0['metrics'])]}; "
          f"step s 1 rank {one['seconds']}, 2 ranks {r0['seconds']}")


def scenario_weights0() -> list[torch.Tensor]:
    return [v for _, v in make_trainer().named_weights()]


def test_two_rank_logprobs_equal_one_rank(runs):
    one, (r0, r1) = runs["one"], runs["train"]
    for key in ("logprobs_before", "logprobs", "ref_logprobs"):
        for b, x, y, z in zip(batches(), one[key], r0[key], r1[key]):
            assert x.shape == y.shape == (len(b), b.input_ids.shape[1] - b.prompt_len)
            assert torch.equal(y, z), key
            torch.testing.assert_close(y * b.loss_mask, x * b.loss_mask, rtol=0, atol=2e-5)
    # the reference model is frozen: its log-probs after training are the policy's before (up
    # to rounding: its gathered weights sit at other addresses), while the policy moved
    for b, x, y, z in zip(batches(), r0["logprobs_before"], r0["ref_logprobs"], r0["logprobs"]):
        torch.testing.assert_close(y * b.loss_mask, x * b.loss_mask, rtol=0, atol=1e-6)
        assert float(((z - x) * b.loss_mask).abs().max()) > 1e-3


def test_sharded_tensors_are_gathered_several_per_collective(runs):
    for got in (r["got"] for r in runs["gather"]):
        assert list(got) == list(runs["gather"][0]["want"])
        for k, v in runs["gather"][0]["want"].items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_two_rank_named_weights_are_full_hf_tensors(runs):
    one, (r0, _) = runs["one"], runs["train"]
    names = list(make_trainer().model.state_dict())
    assert list(r0["weights"]) == names == list(one["weights"])
    for k, v in r0["weights"].items():
        assert not hasattr(v, "device_mesh") and v.shape == one["weights"][k].shape, k


def test_load_weights_keeps_each_rank_shard(runs):
    r0, r1 = runs["load_weights"]
    assert_weights_close(r0["src"], r0["weights"], 0, "loaded vs source")
    assert_weights_close(r1["src"], r1["weights"], 0, "loaded vs source (rank 1)")
    t = make_trainer()
    t.load_weights(r0["src"].items())
    for b, x, y in zip(batches(), [t.logprobs(b) for b in batches()], r0["logprobs"]):
        torch.testing.assert_close(y * b.loss_mask, x * b.loss_mask, rtol=0, atol=2e-5)


def test_checkpoint_from_two_ranks_resumes_at_one_rank(runs):
    one, r0 = runs["one"], runs["train"][0]
    t = make_trainer()
    t.load(str(runs["tmp"] / "ckpt_w2"))
    res = run_steps(t, [2])
    assert t.ref is not None
    assert res["metrics"][0]["loss"] == pytest.approx(one["metrics"][2]["loss"], rel=1e-5, abs=1e-6)
    assert res["metrics"][0]["lr"] == one["metrics"][2]["lr"]
    assert_weights_close(one["weights"], res["weights"], 2e-5, "w2 -> w1 resume vs uninterrupted w1")
    assert_weights_close(r0["weights"], res["weights"], 2e-5, "w2 -> w1 resume vs uninterrupted w2")


def test_checkpoint_from_one_rank_resumes_at_two_ranks(runs):
    one, (r0, r1) = runs["one"], runs["resume"]
    assert [untimed(m) for m in r0["metrics"]] == [untimed(m) for m in r1["metrics"]]
    assert r0["metrics"][0]["loss"] == pytest.approx(one["metrics"][2]["loss"], rel=1e-5, abs=1e-6)
    assert_weights_close(one["weights"], r0["weights"], 2e-5, "w1 -> w2 resume vs uninterrupted w1")
    for x, y in zip(one["ref_logprobs"], r0["ref_logprobs"]):
        torch.testing.assert_close(x, y, rtol=0, atol=2e-5)


def test_rank_slices_balance_rows_and_keep_groups_when_cheap():
    from miles_plugin_fsdp2.dist import rank_slices

    def sizes(runs, world):
        r = rank_slices(runs, world)
        assert r[0].start == 0 and r[-1].stop == sum(runs)
        assert all(a.stop == b.start for a, b in zip(r, r[1:]))
        return [len(x) for x in r]

    assert sizes([4] * 4, 2) == [8, 8]  # whole groups
    assert sizes([5, 3], 2) == [5, 3]  # a cut moves by one row to keep a group whole
    assert sizes([4] * 3, 2) == [6, 6]  # moving 2 rows of 6 costs more than splitting a group
    assert sizes([1] * 7, 4) == [2, 2, 1, 2]
    assert sizes([1], 2) == [1, 0]  # fewer rows than ranks: a rank idles (runs a dummy row)
    assert sizes([8] * 8, 8) == [8] * 8


def test_world_size_that_disagrees_with_the_launcher_is_an_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(MilesError, match="trainer.world_size=2"):
        make_trainer(world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(MilesError, match="env WORLD_SIZE says 2"):
        make_trainer(world_size=1)


@pytest.mark.gpu
def test_cuda_ranks_match_one_rank(tmp_path):
    """2 ranks over NCCL when there are 2 GPUs (fp32 close, bf16 loosely, a checkpoint resumed at
    1 rank); else FSDP2 bf16 mixed precision on one GPU. Against 1 rank, fp32, unsharded."""
    import torch.distributed as dist

    assert torch.cuda.is_available()
    one = scenario_train(device="cuda")
    ckpt = str(tmp_path / "ckpt")
    if torch.cuda.device_count() >= 2:
        r0, r1 = launch_two(tmp_path, "train", device="cuda", mixed_precision="fp32", ckpt=ckpt)
        assert r0["metrics"] == r1["metrics"]
        for a, b in zip(one["metrics"], r0["metrics"]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
        assert_weights_close(one["weights"], r0["weights"], 2e-4, "2 GPUs fp32 vs 1", noise_atol=2e-3)
        t = make_trainer(device="cuda")
        t.load(ckpt)
        resumed = run_steps(t, [2])
        assert resumed["metrics"][0]["loss"] == pytest.approx(one["metrics"][2]["loss"], rel=1e-4, abs=1e-5)
        mixed = launch_two(tmp_path / "bf16", "train", device="cuda", mixed_precision="bf16")[0]
    else:
        try:
            mixed = scenario_train(device="cuda", shard=True, mixed_precision="bf16", ckpt=ckpt)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()  # later tests in this process expect no group
    for a, b in zip(one["metrics"], mixed["metrics"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-2, abs=5e-3)
    w0 = dict(zip(one["weights"], scenario_weights0()))
    moved = sum(float((v.cpu() - w0[k]).abs().mean()) for k, v in one["weights"].items())
    gap = sum(float((v.cpu() - mixed["weights"][k].cpu()).abs().mean()) for k, v in one["weights"].items())
    assert gap < 0.25 * moved, (gap, moved)  # bf16 compute, fp32 master weights: same direction
    print(f"\nGPU: 1-rank step s {one['seconds']}, bf16 step s {mixed['seconds']}, bf16 gap/moved {gap / moved:.3f}")


if __name__ == "__main__":
    from miles_plugin_fsdp2.testing import leave_rank

    main(json.loads(sys.argv[1]))
    leave_rank()
