"""``trainer.compile`` traced on the CPU: the trainer compiles only on CUDA, so the tests compile the
layers with the trainer's ``compile_layers`` and a backend that records dynamo's graphs and runs them
eagerly. transformers' chunked gated delta rule (Qwen3-Next) and megatron-core's MoE layer must stay
out of those graphs: dynamo would recompile them at each new chunk count or sequence length (minutes
of compilation on a GPU, then eager frames past dynamo's recompile limit)."""
import torch
from frontier import Spec
from helpers import batch
from miles_plugin_megatron.config import MegatronConfig


def _recorder() -> tuple[list[torch.fx.GraphModule], object]:
    """A dynamo backend that keeps each graph it gets and runs it eagerly."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    return graphs, record


def test_compiled_layers_keep_the_delta_rule_eager_and_score_as_uncompiled(megatron_cpu):
    from miles_plugin_megatron.compiled import compile_layers
    from miles_plugin_megatron.trainer import MegatronTrainer

    tr = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32"), spec=Spec("qwen3_next"), tokenizer=None,
                         seed=0)
    b = batch(rows=2)
    plain = tr.logprobs(b)
    graphs, record = _recorder()
    torch._dynamo.reset()
    try:
        compile_layers(tr.policy_module(), backend=record)
        compiled = tr.logprobs(b)
    finally:
        torch._dynamo.reset()
    ops = {n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert torch.conv1d in ops  # the DeltaNet's convolution (and projections) still compile
    assert torch.linalg.solve_triangular not in ops  # the delta rule's first step: not traced
    torch.testing.assert_close(compiled, plain, atol=1e-5, rtol=0)


def test_compiled_moe_layers_compile_once_across_lengths_and_score_as_uncompiled(megatron_cpu):
    from miles_plugin_megatron.compiled import compile_layers
    from miles_plugin_megatron.trainer import MegatronTrainer

    tr = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32"), spec=Spec("glm4_moe"), tokenizer=None,
                         seed=0)
    bs = [batch(seed=3 + i, rows=2, response=n) for i, n in enumerate((5, 9, 14, 20, 27))]
    plain = [tr.logprobs(b) for b in bs]
    graphs, record = _recorder()
    torch._dynamo.reset()
    try:
        compile_layers(tr.policy_module(), backend=record)
        compiled, counts = [], []
        for b in bs:
            compiled.append(tr.logprobs(b))
            counts.append(len(graphs))
    finally:
        torch._dynamo.reset()
    # the first two lengths settle dynamo's sizes 0/1 specialization; later lengths reuse the graphs
    assert counts[1] == counts[-1], counts
    ops = {n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert torch.topk not in ops  # the router's top-k: the MoE layer runs eagerly
    for c, p in zip(compiled, plain):
        torch.testing.assert_close(c, p, atol=1e-5, rtol=0)
