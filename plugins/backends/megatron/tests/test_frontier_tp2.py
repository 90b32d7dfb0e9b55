"""DeepSeek-V4 and gpt-oss at tensor_parallel=2 on two gloo ranks (tp2_worker.py; one launch for
both). V4's attention (transformers' own module) splits by head (in whole output groups; what its
heads share is whole on both ranks), as do its experts, shared expert, embedding and output layer;
gpt-oss' heads split with their sinks and biases, its biased experts stay whole on both ranks. The
weights go HF -> TP=2 shards -> HF bit-exactly, the log-probs equal transformers' in fp32, and one
optimizer step has one rank's loss, gradients (the norm and every tensor) and updated weights; the
replicated tensors stay equal on both ranks, and the TP=2 checkpoint resumes on one rank."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from frontier import hf_model
from helpers import batch
from tp2_worker import FAMILIES, step_with_grads, trainer

HERE = Path(__file__).parent
# (name, this rank's shape at TP=2) of tensors that must be whole or halved on each rank
LAYOUT = {
    "deepseek_v4": (("decoder.layers.1.self_attention.hf.q_b_proj.weight", (64, 24)),  # 2 of 4 heads x 32
                    ("decoder.layers.1.self_attention.hf.sinks", (2,)),
                    ("decoder.layers.1.self_attention.hf.o_a_proj.weight", (16, 64)),  # 1 of 2 groups
                    ("decoder.layers.1.self_attention.hf.kv_proj.weight", (32, 64)),  # the shared KV head, whole
                    ("decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight", (64, 16)),  # 32 / 2
                    ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", (32, 64)),  # [gate; up] halves
                    ("output_layer.weight", (51, 64))),  # 101 rows padded to 102, halved
    "gpt_oss": (("decoder.layers.0.self_attention.core_attention.softmax_offset", (2,)),  # 4 heads / 2
                ("decoder.layers.0.self_attention.linear_qkv.bias", (64,)),  # one KV group of 2 + 1 + 1 heads x 16
                ("decoder.layers.0.self_attention.linear_proj.weight", (64, 32)),
                ("decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight", (64, 64)),  # whole
                ("decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.bias", (64,))),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", "29541", str(HERE / "tp2_worker.py"), str(out)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_2_matches_transformers_and_one_rank(two_ranks, megatron_cpu, family):
    ranks = [torch.load(two_ranks / f"{family}_rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        assert r["export_equal"] and r["lp_diff"] < 1e-5
        for name, shape in LAYOUT[family]:
            assert r["shapes"][name] == shape, name
    assert ranks[0]["loss"] == ranks[1]["loss"]
    replicated = ranks[0]["replicated"]
    assert any(".self_attention.hf." in k or ".local_experts." in k for k in replicated)
    for k, v in replicated.items():
        assert torch.equal(ranks[1]["replicated"][k], v), k
    one = trainer(family, 1)
    b = batch(rows=5)
    m, grads = step_with_grads(one, b)
    assert abs(m["loss"] - ranks[0]["loss"]) < 1e-6
    assert abs(m["grad_norm"] - ranks[0]["grad_norm"]) < 1e-5 * m["grad_norm"]
    assert set(grads) == set(ranks[0]["grads"])
    for k, g in grads.items():
        got = ranks[0]["grads"][k][:g.shape[0]]  # the vocabulary's padding row at TP=2 cut off
        assert (got - g).abs().max() <= 1e-3 * g.abs().max(), k
    mine = dict(one.named_weights())
    for k, v in ranks[0]["weights"].items():
        assert (mine[k] - v).abs().max() < 1e-4, k
    assert (one.logprobs(b) - ranks[0]["after"]).abs().max() < 1e-5
    one.load_weights(hf_model(family).state_dict().items())  # back to the first weights
    assert (one.logprobs(b) - ranks[0]["after"]).abs().max() > 1e-3
    one.load(str(two_ranks / f"{family}_ckpt"))
    assert (one.logprobs(b) - ranks[0]["after"]).abs().max() < 1e-5
