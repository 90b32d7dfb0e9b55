"""One rank of a 2-rank CPU run (gloo) of the megatron trainer at tensor_parallel=2, started by
test_frontier_tp2.py through torch.distributed.run with the TEST-ONLY CPU shim: DeepSeek-V4
(transformers' attention split by head, what its heads share whole on both ranks; experts, shared
expert, embedding and output layer split) and gpt-oss (heads and their sinks split; biased experts whole on both ranks).

Per family it writes ``OUT/{family}_rank{R}.pt``: the log-probs' distance from transformers', whether
the export is bit-exact, this rank's tensor shapes, one optimizer step's loss, gradient norm and
full (TP-gathered) gradients, the weights and log-probs after it, and this rank's replicated
tensors (which must stay equal on both ranks); and a checkpoint after the step,
``OUT/{family}_ckpt``."""
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import cpu_shim  # noqa: E402
from frontier import Spec, hf_model, unpadded_logprobs  # noqa: E402
from frontier_worker import step  # noqa: E402
from helpers import batch, hf_logprobs  # noqa: E402

FAMILIES = ("deepseek_v4", "gpt_oss")


def trainer(family: str, tp: int) -> Any:
    from miles_plugin_megatron.config import MegatronConfig
    from miles_plugin_megatron.trainer import MegatronTrainer

    cfg = MegatronConfig(device="cpu", precision="fp32", tensor_parallel=tp, lr=1e-3, grad_clip=None)
    return MegatronTrainer(cfg, spec=Spec(family), tokenizer=None, seed=0, total_steps=10)


def transformers_logprobs(family: str, b: Any) -> tuple[torch.nn.Module, torch.Tensor]:
    """The family's transformers model and its log-probs (DeepSeek-V4: each row alone, unpadded)."""
    hf = hf_model(family)
    return hf, (unpadded_logprobs if family == "deepseek_v4" else hf_logprobs)(hf, b)


def step_with_grads(tr: Any, b: Any) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One optimizer step's metrics, and the full gradients (Megatron names) the optimizer got:
    read after the trainer's reduction, gathered over the TP ranks as the weights are."""
    grads: dict[str, torch.Tensor] = {}
    update = tr._update

    def read_then_update(totals: dict, loss_sum: float) -> dict:
        local = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                 for n, p in tr.model.named_parameters()}
        for full in tr.full_groups(tensors=local):
            grads.update(full)
        return update(totals, loss_sum)

    tr._update = read_then_update
    try:
        return step(tr, b), grads
    finally:
        del tr._update


def run(out: str, family: str) -> None:
    import torch.distributed as dist
    from miles_plugin_megatron import convert

    tr = trainer(family, 2)
    b = batch(rows=5)
    mask = b.loss_mask.bool()
    hf, want = transformers_logprobs(family, b)
    hs = hf.state_dict()
    exported = dict(tr.named_weights())
    result = {"lp_diff": float((tr.logprobs(b) - want)[mask].abs().max()),
              "export_equal": set(exported) == set(hs) and all(torch.equal(exported[k], v) for k, v in hs.items()),
              "shapes": {k: tuple(v.shape) for k, v in tr.model.state_dict().items() if not k.endswith("_extra_state")}}
    metrics, grads = step_with_grads(tr, b)
    result.update(loss=metrics["loss"], grad_norm=metrics["grad_norm"], after=tr.logprobs(b),
                  replicated={k: v.clone() for k, v in tr.model.state_dict().items()
                              if not k.endswith("_extra_state") and convert.tp_dim(k, tr.arch) is None})
    weights = dict(tr.named_weights())
    tr.save(str(Path(out) / f"{family}_ckpt"))
    if dist.get_rank() == 0:  # both ranks gather the same full tensors: one writes them
        result.update(grads=grads, weights=weights)
    torch.save(result, Path(out) / f"{family}_rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    cpu_shim.install(pytest.MonkeyPatch())
    for family in FAMILIES:
        run(sys.argv[1], family)
