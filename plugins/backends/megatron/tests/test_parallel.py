"""Two gloo ranks on CPU (torch.distributed.run): tensor_parallel=2 (Qwen2, with the critic),
expert_parallel=2 with data-parallel 2 (Qwen3-MoE), pipeline_parallel=2 (Qwen2, with the critic),
pipeline_parallel=2 with two virtual stages per rank (4-layer Qwen2, with the critic) and routing
replay at pipeline_parallel=2 and at expert_parallel=2 (Qwen3-MoE), Qwen3 with
trainer.precision mxfp8 at tensor_parallel=2, and Llama with trainer.precision fp8 and with
trainer.qat int4 at pipeline_parallel=2. Each builds the model from the
same HF weights, exports them bit-exactly, computes the HF log-probs, takes the same optimizer step
as one rank does, and writes a checkpoint that resumes on one rank; at TP=2 and at EP=2 x DP=2 a
draft head trains to the same replica on both ranks, with one rank's loss."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import batch
from miles_plugin_megatron.config import MegatronConfig
from parallel_worker import LOWP_PP

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    one_rank_checkpoint(out)  # the TP=2 ranks resume it
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", "29517", str(HERE / "parallel_worker.py"), str(out)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    return out


def one_rank_checkpoint(out: Path) -> None:
    """A Qwen2 checkpoint written on one rank after one step (``OUT/ckpt_tp1``) and the log-probs
    it gives (``OUT/tp1_after.pt``)."""
    import cpu_shim

    mp = pytest.MonkeyPatch()
    cpu_shim.install(mp)
    try:
        from parallel_worker import make

        tr = make(MegatronConfig(device="cpu", precision="fp32", lr=1e-3, grad_clip=None), "qwen2")
        b = batch(rows=5)
        tr.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))
        tr.save(str(out / "ckpt_tp1"))
        torch.save(tr.logprobs(b), out / "tp1_after.pt")
    finally:
        from miles_plugin_megatron import parallel

        parallel.destroy()
        mp.undo()


def against_one_rank(out: Path, tag: str, device: str = "cpu") -> list[dict]:
    """Rank results vs the same step on one rank, and the checkpoint resumed on one rank."""
    import cpu_shim

    critic = tag.startswith("qwen2")
    ranks = [torch.load(out / f"{tag}_rank{r}.pt", weights_only=False, map_location="cpu") for r in range(2)]
    for r in ranks:
        assert r["export_equal"]
        assert r["lp_diff"] < 1e-5
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])
    mp = pytest.MonkeyPatch()
    if device == "cpu":
        cpu_shim.install(mp)
    try:
        from parallel_worker import critic_step, make

        cfg = MegatronConfig(device=device, precision="fp32", lr=1e-3, grad_clip=None)
        one = make(cfg, tag, critic=critic)
        b = batch(rows=5)
        m = one.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))
        assert abs(m["loss"] - ranks[0]["loss"]) < 1e-6
        assert abs(m["grad_norm"] - ranks[0]["grad_norm"]) < 1e-4
        mine = {k: v.cpu() for k, v in one.named_weights()}
        for k, v in ranks[0]["weights"].items():
            assert (mine[k] - v).abs().max() < 1e-5, k
        if critic:  # the critic at TP=2 / PP=2 computes and learns as on one rank
            assert (critic_step(one, b) - ranks[0]["values"]).abs().max() < 1e-4
            assert ranks[0]["values"].abs().max() > 0.1
            assert (one.values(b) - ranks[0]["values_after"]).abs().max() < 1e-4
        # the checkpoint written at TP=2 (EP=2 x DP=2, PP=2) through dist_checkpointing, read on one rank
        resumed = make(cfg, tag, seed=3, critic=critic)
        resumed.load(str(out / f"ckpt_{tag}"))
        assert (resumed.logprobs(b) - ranks[0]["after"]).abs().max() < 1e-5
        m1 = one.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))
        m2 = resumed.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))
        assert abs(m1["loss"] - m2["loss"]) < 1e-5  # the AdamW moments and step came back too
        assert (resumed.logprobs(b) - one.logprobs(b)).abs().max() < 1e-4
        if critic:
            assert (resumed.values(b) - ranks[0]["values_after"]).abs().max() < 1e-4
        if "draft_head" in ranks[0]:  # the draft head: the same replica on every rank, the loss of one rank
            from parallel_worker import drafting

            for k, v in ranks[0]["draft_head"].items():
                assert torch.equal(ranks[1]["draft_head"][k], v), k
            assert ranks[0]["draft"] == ranks[1]["draft"]
            d = drafting(cfg, tag)
            m = d.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))
            assert abs(m["draft_loss"] - ranks[0]["draft"]) < 1e-5 and m["draft_loss"] > 1e-2
    finally:
        from miles_plugin_megatron import parallel

        parallel.destroy()
        mp.undo()
    return ranks


@pytest.mark.slow
def test_tensor_parallel_2(two_ranks):
    ranks = against_one_rank(two_ranks, "qwen2")  # GQA + QKV bias, tied, odd vocabulary (padded)
    want = torch.load(two_ranks / "tp1_after.pt")  # a one-rank checkpoint resumed at TP=2
    assert all((r["from_tp1"] - want).abs().max() < 1e-5 for r in ranks)
    assert ranks[0]["local_qkv_rows"] == (8 + 2 * 4) * 8 // 2  # half the KV groups with their queries


@contextlib.contextmanager
def one_rank():
    """megatron-core on CPU in this process, with a process group of one rank for the block."""
    import cpu_shim

    mp = pytest.MonkeyPatch()
    cpu_shim.install(mp)
    try:
        yield
    finally:
        from miles_plugin_megatron import parallel

        parallel.destroy()
        mp.undo()


@pytest.mark.slow
def test_mxfp8_tensor_parallel_2(two_ranks):
    """trainer.precision mxfp8 at TP=2: each shard's 32-element blocks are the whole weight's, so
    the log-probs equal the HF model's with libs/lowp's rounding, and one step has one rank's loss
    and gradients (the norm and every tensor: the input gradients summed over the TP ranks);
    fp8's 128-row blocks would be cut."""
    ranks = [torch.load(two_ranks / f"lowp_tp2_rank{r}.pt", weights_only=False) for r in range(2)]
    for res in ranks:
        for when in ("before", "after"):
            got, want, plain, mask = res[when]
            assert ((got - want) * mask).abs().max() < 2e-5, when
            assert ((got - plain) * mask).abs().max() > 1e-3, when
        assert res["loss"][1] < res["loss"][0]
        assert torch.equal(res["strided_grad"], torch.full((3, 4), 3.0))  # 1 + 2: both ranks' gradients
        assert "trainer.precision: fp8 with trainer.tensor_parallel: 2" in res["fp8_refused"]
    with one_rank():
        from parallel_worker import make
        from tp2_worker import step_with_grads

        one = make(MegatronConfig(device="cpu", precision="mxfp8", lr=1e-3, grad_clip=None), "qwen3")
        m, grads = step_with_grads(one, batch(rows=5))
    assert abs(m["loss"] - ranks[0]["loss"][0]) < 1e-6
    assert abs(m["grad_norm"] - ranks[0]["grad_norm"]) < 1e-5 * m["grad_norm"]
    assert set(grads) == set(ranks[0]["grads"])
    for k, g in grads.items():
        got = ranks[0]["grads"][k][:g.shape[0]]  # the vocabulary's padding row at TP=2 cut off
        assert (got - g).abs().max() <= 1e-3 * g.abs().max(), k


@pytest.mark.slow
@pytest.mark.parametrize("tag", LOWP_PP)
def test_low_precision_pipeline_parallel_2(two_ranks, tag):
    """trainer.precision fp8 and trainer.qat int4 at pipeline_parallel=2 (a 2-layer Llama, one layer
    per stage): each stage's linears compute in the format, and the log-probs, one step's loss and
    gradient norm and the log-probs after it are one rank's."""
    from parallel_worker import lowp_pp_config, make

    ranks = [torch.load(two_ranks / f"{tag}_rank{r}.pt", weights_only=False) for r in range(2)]
    for r, res in enumerate(ranks):  # the attention and MLP projections of this stage's layer
        assert [n.split(".")[-1] for n in res["lowp_linears"]] == ["linear_proj", "linear_qkv",
                                                                   "linear_fc1", "linear_fc2"], r
    mask = ranks[0]["mask"]
    with one_rank():
        one = make(lowp_pp_config(LOWP_PP[tag], 1), "llama")
        b = batch(rows=5)
        lp = one.logprobs(b)
        m = one.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))
        after = one.logprobs(b)
    assert ((lp - ranks[0]["plain"]) * mask).abs().max() > 1e-3  # the rounding runs
    for res in ranks:
        assert ((res["lp"] - lp) * mask).abs().max() < 2e-5
        assert ((res["after"] - after) * mask).abs().max() < 2e-5
        assert abs(res["loss"] - m["loss"]) < 1e-5 * abs(m["loss"])
        assert abs(res["grad_norm"] - m["grad_norm"]) < 1e-5 * m["grad_norm"]


@pytest.mark.slow
def test_expert_parallel_2_data_parallel_2(two_ranks):
    ranks = against_one_rank(two_ranks, "qwen3_moe")
    experts = [n for n in ranks[0]["local_names"]
               if n.startswith("decoder.layers.0.mlp.experts.") and n.endswith(".weight")]
    assert len(experts) == 2 * 2  # 2 of the 4 experts per rank, fc1 and fc2 each


@pytest.mark.slow
def test_pipeline_parallel_2(two_ranks):
    """Two stages (one decoder layer each, tied embeddings: a copy on each end) through megatron-core's
    1F1B schedule over gloo: log-probs, the training step, the export, the critic (values and a
    step through the same schedule) and the checkpoint (critic included) as on one rank."""
    ranks = against_one_rank(two_ranks, "qwen2_pp2")
    assert {n.split(".")[0] for n in ranks[0]["local_names"]} == {"embedding", "decoder"}
    assert "output_layer.weight" in ranks[1]["local_names"] and "embedding" not in str(ranks[1]["local_names"])
    assert not any(n.startswith("decoder.layers.1.") for r in ranks for n in r["local_names"])


@pytest.mark.slow
def test_virtual_pipeline_stages(two_ranks):
    """Two ranks, two virtual stages each (4 layers: rank 0 runs layers 0 and 2, rank 1 layers 1
    and 3) through megatron-core's interleaved 1F1B schedule: log-probs, the training step, the
    export, the critic and the checkpoint (resumed without pipeline stages) as on one rank."""
    ranks = against_one_rank(two_ranks, "qwen2_vpp2")
    assert {n.split(".")[0] for n in ranks[0]["local_names"]} == {"chunks"}
    assert "chunks.0.embedding.word_embeddings.weight" in ranks[0]["local_names"]
    assert "chunks.1.output_layer.weight" in ranks[1]["local_names"]  # the tied embedding's copy
    for r in ranks:  # one layer per chunk
        assert not any(".layers.1." in n for n in r["local_names"])
        assert any(n.startswith("chunks.1.decoder.layers.0.") for n in r["local_names"])


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["r3_pp2", "r3_ep2"])
def test_routing_replay_across_pipeline_stages_and_expert_ranks(two_ranks, tag):
    """R3 at pipeline_parallel=2 (the second stage's routers replay the second layer's records) and
    at expert_parallel=2 x data-parallel 2 (each rank's rows, one topped up with a copy): the
    log-probs are the fsdp2 path's (the moe spec's replaying forward), which differ from plain
    routing."""
    for r in range(2):
        res = torch.load(two_ranks / f"{tag}_rank{r}.pt")
        mask = res["mask"]
        assert ((res["lp"] - res["want"]) * mask).abs().max() < 1e-5
        assert ((res["want"] - res["plain"]) * mask).abs().max() > 1e-3


@pytest.mark.slow
def test_miles_train_two_ranks(tmp_path):
    """``miles train`` with trainer.world_size=2 at pipeline_parallel=2: the local launcher starts
    the ranks, each loads the CPU stand-ins as a launch-time plugin; the engine in rank 0 gets the
    weights gathered from both stages (its log-probs equal the trainer's). Tensor-parallel weight
    gathering and resuming on one rank are covered through the trainer API above."""
    import json

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model: {name: hf, config: {model_type: qwen2, hidden_size: 64, intermediate_size: 128, "
        "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
        "max_position_embeddings: 32, tie_word_embeddings: true}}\n"
        "env: {name: arith, digits: 2, eval_size: 16}\n"
        "rollout: {batch_size: 8, n: 4, temperature: 1.0, max_new_tokens: 4}\n"
        "engine: {name: torch}\nalgorithm: {name: grpo, filter_zero_variance: false}\n"
        "trainer: {name: megatron, device: cpu, precision: fp32, lr: 1.0e-3}\nsync: {name: tensor}\n"
        f"run: {{steps: 2, out_dir: {tmp_path / 'out'}, eval_every: 2, checkpoint_every: 2, threads: 1}}\n")
    base = [sys.executable, "-m", "miles.cli", "train", str(cfg), "--plugin", str(HERE / "cpu_shim_plugin.py"),
            "--plugin", str(HERE / "even_token_reward.py")]
    subprocess.run(base + ["trainer.world_size=2", "trainer.pipeline_parallel=2", "trainer.micro_batch_size=8"],
                   check=True, timeout=600)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["grad_norm"] > 0 for r in steps)
    assert (tmp_path / "out" / "checkpoints" / "step_000002" / "trainer" / "metadata.json").exists()
    assert max(r["train_rollout_logprob_abs_diff"] for r in steps) < 1e-5
