"""What the megatron trainer does to megatron-core's modules for speed on one tensor-parallel rank
keeps its numbers: plain-``F.linear`` projections (one traceable graph per compiled layer) and an
output layer that writes batch-major logits (no copy of the ``[B, S, V]`` logits or their
gradient)."""
import torch
from helpers import Spec, batch
from miles_plugin_megatron.config import MegatronConfig


def make(family: str = "qwen2", **cfg):
    from miles_plugin_megatron.trainer import MegatronTrainer

    return MegatronTrainer(MegatronConfig(device="cpu", precision="fp32", **cfg), spec=Spec(family),
                           tokenizer=None, total_steps=10)


def test_one_rank_linears_compute_what_megatrons_compute(megatron_cpu):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from miles_plugin_megatron.arch import one_rank_linears

    layer = make().model.decoder.layers[0]
    column, row = one_rank_linears()
    mods = {"qkv": layer.self_attention.linear_qkv, "proj": layer.self_attention.linear_proj,
            "fc1": layer.mlp.linear_fc1, "fc2": layer.mlp.linear_fc2}
    assert [type(m) for m in mods.values()] == [column, row, column, row]
    assert mods["qkv"].bias is not None  # Qwen2's QKV bias goes through the one-rank forward too
    for name, m in mods.items():
        parent = ColumnParallelLinear if isinstance(m, column) else RowParallelLinear
        x = torch.randn(5, 3, m.weight.shape[1], requires_grad=True)
        mine, theirs = m(x), parent.forward(m, x)
        assert (mine[1] is None) == (theirs[1] is None), name
        assert torch.allclose(mine[0], theirs[0], atol=1e-6), name
        g = torch.randn_like(mine[0])
        got = torch.autograd.grad(mine[0], (x, m.weight), g)
        want = torch.autograd.grad(theirs[0], (x, m.weight), g)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5), name


def test_compiled_layer_is_one_graph_but_megatrons_own_context_manager(megatron_cpu):
    """torch.compile traces a decoder layer whole except at megatron-core's activation-offload
    context manager around the attention output projection (one break; with megatron's own
    linears it was eight)."""
    tr = make()
    layer = tr.model.decoder.layers[0]
    x = torch.randn(6, 2, 64, requires_grad=True)
    explained = torch._dynamo.explain(layer)(x, attention_mask=None, rotary_pos_emb=tr.model.rotary_pos_emb(6))
    assert explained.graph_break_count <= 1, [b.reason for b in explained.break_reasons]


def test_logits_come_out_batch_major_without_a_copy(megatron_cpu):
    tr = make("llama")
    b = batch()
    seen = {}
    tr.model.output_layer.register_forward_hook(lambda m, a, out: seen.update(logits=out[0]))
    ids = b.input_ids
    logits = tr.model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    assert logits.shape == (*ids.shape, tr.model.output_layer.weight.shape[0]) and logits.is_contiguous()
    assert logits.data_ptr() == seen["logits"].data_ptr()  # the layer's own product, not a copy
    hidden = {}
    tr.model.decoder.register_forward_hook(lambda m, a, out: hidden.update(h=out))
    tr.model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    want = (hidden["h"] @ tr.model.output_layer.weight.T).transpose(0, 1)  # sequence-major, then B-first
    assert torch.allclose(logits, want, atol=1e-5)
