"""``trainer.compile`` on Qwen3-Next's layers, traced on the CPU: the trainer compiles only on CUDA,
so the test compiles each ``TransformerLayer`` as the trainer does (``dynamic=True``), with a backend
that records dynamo's graphs and runs them eagerly. transformers' chunked gated delta rule must stay
out of those graphs: dynamo unrolls its loop over 64-token chunks, so each new chunk count would
recompile the layer (minutes of compilation on a GPU)."""
import torch
from frontier import Spec
from helpers import batch
from miles_plugin_megatron.config import MegatronConfig


def test_compiled_layers_keep_the_delta_rule_eager_and_score_as_uncompiled(megatron_cpu):
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from miles_plugin_megatron.trainer import MegatronTrainer

    tr = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32"), spec=Spec("qwen3_next"), tokenizer=None,
                         seed=0)
    b = batch(rows=2)
    plain = tr.logprobs(b)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        for m in tr.policy_module().modules():
            if isinstance(m, TransformerLayer):
                m.compile(dynamic=True, backend=record)
        compiled = tr.logprobs(b)
    finally:
        torch._dynamo.reset()
    ops = {n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert torch.conv1d in ops  # the DeltaNet's convolution (and projections) still compile
    assert torch.linalg.solve_triangular not in ops  # the delta rule's first step: not traced
    torch.testing.assert_close(compiled, plain, atol=1e-5, rtol=0)
