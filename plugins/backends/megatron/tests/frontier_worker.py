"""One rank of a 2-rank CPU run (gloo) of the megatron trainer on DeepSeek-V3, GLM-4.5, GLM-5, gpt-oss and Qwen3-Next
(``frontier.py``), started by test_frontier.py through torch.distributed.run with the TEST-ONLY
CPU shim: each family at tensor_parallel=2 and at expert_parallel=2 (so data-parallel 2). Writes
the log-probs' distance from transformers, whether the export is bit-exact, and one optimizer
step's loss, gradient norm and log-probs after it to ``OUT/{family}_tp{T}_ep{E}_rank{R}.pt``."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import cpu_shim  # noqa: E402
from frontier import Spec, hf_model  # noqa: E402
from helpers import batch, hf_logprobs  # noqa: E402

CASES = [(family, tp, ep) for family in ("deepseek_v3", "glm4_moe") for tp, ep in ((2, 1), (1, 2))]
CASES.append(("gpt_oss", 1, 2))  # gpt-oss and DeepSeek-V4 at TP=2: tp2_worker.py
# Qwen3-Next: the DeltaNet heads split over two TP ranks, and EP=2 with its dense first layer
CASES += [("qwen3_next", 2, 1), ("qwen3_next", 1, 2)]
# GLM-5: every TP rank runs the replicated indexer on the same inputs, so they keep the same keys
CASES.append(("glm_moe_dsa", 2, 1))


def step(trainer, b):
    return trainer.train_step(b, lambda mb, lp: (-mb.token_mean(lp * mb.advantages), {}))


def case_batch(family: str):
    return batch(rows=5, **({"prompt": 8, "response": 8} if family == "glm_moe_dsa" else {}))  # GLM-5: keys dropped


def run(out: str, family: str, tp: int, ep: int) -> None:
    import torch.distributed as dist
    from miles_plugin_megatron.config import MegatronConfig
    from miles_plugin_megatron.trainer import MegatronTrainer

    cfg = MegatronConfig(device="cpu", precision="fp32", tensor_parallel=tp, expert_parallel=ep, lr=1e-3,
                         grad_clip=None)
    tr = MegatronTrainer(cfg, spec=Spec(family), tokenizer=None, seed=0, total_steps=10)
    b = case_batch(family)
    hf = hf_model(family)
    lp = tr.logprobs(b)
    mask = b.loss_mask.bool()
    hs = hf.state_dict()
    exported = dict(tr.named_weights())
    result = {"lp_diff": float((lp - hf_logprobs(hf, b))[mask].abs().max()),
              "export_equal": set(exported) == set(hs) and all(torch.equal(exported[k], v) for k, v in hs.items())}
    metrics = step(tr, b)
    result.update(loss=metrics["loss"], grad_norm=metrics["grad_norm"], after=tr.logprobs(b))
    if family == "qwen3_next" and tp == 2:  # changed weights in a TP=2 checkpoint, for a one-rank resume
        with torch.no_grad():
            for p in tr.model.parameters():
                p.add_(0.01)
        tr.weights_changed()
        result["changed"] = tr.logprobs(b)
        tr.save(str(Path(out) / "qwen3_next_tp2_checkpoint"))
    torch.save(result, Path(out) / f"{family}_tp{tp}_ep{ep}_rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    cpu_shim.install(pytest.MonkeyPatch())
    for case in CASES:
        run(sys.argv[1], *case)
