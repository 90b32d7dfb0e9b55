"""On a CUDA GPU (``pytest -m gpu``): ``engine.cuda_graphs`` samples exactly what the eager
sampler does (the same kernels, replayed from a graph): images, latents and log-probs equal bit
for bit, ODE and SDE, with and without guidance; a graph per batch shape, the most recent four
kept; and a weight sync (in-place copies) reaches the captured graph as it reaches eager calls."""
import pytest
import torch
from miles_plugin_diffusers.config import DiffusersEngineConfig, DiffusersModelConfig, ShapesEnvConfig
from miles_plugin_diffusers.engine import DiffusersEngine
from miles_plugin_diffusers.env import ShapesEnv
from miles_plugin_diffusers.spec import DiffusersSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPTS = ["a red square", "a blue circle", "a green square", "a yellow circle"]


@pytest.fixture(scope="module")
def setup():
    # latent space (16x16 images, 8x8x4 latents), as the GPU recipe samples
    spec = DiffusersSpec(DiffusersModelConfig(image_size=16, vae={"block_out_channels": [16, 16]},
                                              transformer={"num_layers": 2}))
    return spec, spec.build_tokenizer(ShapesEnv(ShapesEnvConfig()).tokenizer())


def _engines(setup, **cfg):
    spec, tok = setup
    return tuple(DiffusersEngine(DiffusersEngineConfig(num_steps=4, device="cuda", cuda_graphs=flag, **cfg),
                                 spec=spec, tokenizer=tok) for flag in (True, False))


def _assert_same(a, b):
    for k in ("images", "latents", "logprobs", "embeds", "pooled"):
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, k
            continue
        assert torch.equal(a[k], b[k]), f"{k}: max abs diff {float((a[k] - b[k]).abs().max()):.3e}"


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_graph_sampling_equals_eager_bit_for_bit(setup, guidance):
    graphs, eager = _engines(setup, guidance_scale=guidance)
    assert graphs._graphs is not None and eager._graphs is None
    ids = graphs.encode(PROMPTS[:3])
    for stochastic in (False, True):
        for trajectory in (True, False):
            a, b = (e.sample(ids, [1, 2, 3], stochastic, step_seed=5, trajectory=trajectory)
                    for e in (graphs, eager))
            _assert_same(a, b)
            assert a["latents"].shape[1] == (5 if trajectory else 1)
    assert len(graphs._graphs) == 1  # one batch shape: one graph, replayed by every call and step
    # another batch size gets its own graph; the first is still replayed, with new conditioning
    ids2 = graphs.encode(PROMPTS[2:])
    _assert_same(*(e.sample(ids2, [7, 8], True, step_seed=6) for e in (graphs, eager)))
    assert len(graphs._graphs) == 2
    _assert_same(*(e.sample(ids[::-1], [3, 2, 1], False) for e in (graphs, eager)))
    assert len(graphs._graphs) == 2


def test_graphs_are_kept_for_the_four_latest_batch_shapes(setup):
    graphs, eager = _engines(setup)
    # batch size 1's graph is dropped for the fifth shape's, then captured again
    for n, kept in zip((1, 2, 3, 4, 5, 1), (1, 2, 3, 4, 4, 4)):
        ids = graphs.encode((PROMPTS * 2)[:n])
        _assert_same(*(e.sample(ids, list(range(n)), True, step_seed=n) for e in (graphs, eager)))
        assert len(graphs._graphs) == kept
    assert [k[0][0] for k in graphs._graphs._graphs] == [3, 4, 5, 1]  # least recently used first


def test_a_weight_sync_reaches_the_captured_graph(setup):
    graphs, eager = _engines(setup)
    ids, seeds = graphs.encode(PROMPTS), [1, 2, 3, 4]
    before = graphs.sample(ids, seeds, False)
    _assert_same(before, eager.sample(ids, seeds, False))
    gen = torch.Generator().manual_seed(0)
    new = [(n, p.cpu() + 0.05 * torch.randn(p.shape, generator=gen)) for n, p in graphs.model.named_parameters()]
    for e in (graphs, eager):
        e.load_weights(new, version=1)
    after = graphs.sample(ids, seeds, False)
    _assert_same(after, eager.sample(ids, seeds, False))
    assert not torch.equal(after["latents"], before["latents"])  # the graph computed with the new weights
    assert len(graphs._graphs) == 1  # replayed, not recaptured
