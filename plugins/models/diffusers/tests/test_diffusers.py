import pytest
import torch
from miles import MilesError, SamplingParams, Task
from miles_plugin_diffusers import shapes
from miles_plugin_diffusers.config import (
    DiffusersEngineConfig,
    DiffusersModelConfig,
    DiffusionRolloutConfig,
    ShapesEnvConfig,
)
from miles_plugin_diffusers.engine import DiffusersEngine
from miles_plugin_diffusers.env import ShapesEnv
from miles_plugin_diffusers.rollout import DiffusionRollout, stack_trajectories
from miles_plugin_diffusers.spec import DiffusersSpec, trajectory_logprobs
from pydantic import ValidationError

TINY = {"num_layers": 1}


@pytest.fixture(scope="module")
def parts():
    env = ShapesEnv(ShapesEnvConfig(colours=["red", "blue"], shapes=["square"], eval_images=2))
    spec = DiffusersSpec(DiffusersModelConfig(transformer=TINY))
    tok = spec.build_tokenizer(env.tokenizer())
    engine = DiffusersEngine(DiffusersEngineConfig(num_steps=4), spec=spec, tokenizer=tok)
    return env, spec, tok, engine


def _rollout(parts, params, n=3, split="train", **cfg):
    env, _, tok, engine = parts
    return DiffusionRollout(DiffusionRolloutConfig(**cfg)).generate(env.tasks(split), n, engine=engine, env=env,
                                                                   tokenizer=tok, params=params)


def test_recomputed_sde_logprobs_equal_the_rollout_bit_for_bit(parts):
    _, spec, tok, engine = parts
    samples = [s for g in _rollout(parts, SamplingParams(seed=7)) for s in g]
    assert all(len(s.logprobs) == 4 and s.loss_mask == [1] * 4 and s.response_ids == [] for s in samples)
    model = spec.build_model(tok).train()  # a fresh build: the same weights as the engine's
    extras = stack_trajectories(samples)
    lp = trajectory_logprobs(model, extras, torch.ones(len(samples), 4))
    assert torch.equal(lp.detach(), torch.tensor([s.logprobs for s in samples]))
    lp.sum().backward()  # differentiable in the transformer's weights
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    # steps with loss_mask 0 everywhere are skipped (0), the others unchanged
    mask = torch.tensor([[1.0, 0, 1, 0]] * len(samples))
    part = trajectory_logprobs(model, extras, mask).detach()
    assert torch.equal(part[:, [0, 2]], lp.detach()[:, [0, 2]]) and not part[:, [1, 3]].any()


def test_ode_sampling_is_deterministic_and_sde_is_not(parts):
    ode = SamplingParams(temperature=0.0)
    a = [s.extensions["diffusers"]["image"] for g in _rollout(parts, ode, n=1, split="eval") for s in g]
    b = [s.extensions["diffusers"]["image"] for g in _rollout(parts, ode, n=1, split="eval") for s in g]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])  # another noise seed, another image
    s1 = _rollout(parts, SamplingParams(seed=1), n=1)[0][0].extensions["diffusers"]["image"]
    s2 = _rollout(parts, SamplingParams(seed=2), n=1)[0][0].extensions["diffusers"]["image"]
    assert not torch.equal(s1, s2)


def test_eval_grid_is_written_per_weight_version(parts, tmp_path):
    parts[3].weight_version = 3
    _rollout(parts, SamplingParams(temperature=0.0), n=1, split="eval", samples_dir=str(tmp_path))
    from PIL import Image

    img = Image.open(tmp_path / "step_000003.png")
    assert img.size[0] > 16 and img.size[1] > 16
    # without samples_dir: <run.out_dir>/samples (the factory's out_dir context)
    env, _, tok, engine = parts
    DiffusionRollout(DiffusionRolloutConfig(), out_dir=str(tmp_path / "run")).generate(
        env.tasks("eval"), 1, engine=engine, env=env, tokenizer=tok, params=SamplingParams(temperature=0.0))
    assert (tmp_path / "run" / "samples" / "step_000003.png").is_file()


def test_weights_load_into_the_engine(parts):
    _, spec, tok, engine = parts
    model = spec.build_model(tok)
    named = [(n, torch.zeros_like(p)) for n, p in model.named_parameters()]
    engine.load_weights(named[:1], version=5)
    assert engine.weight_version == 5 and not engine.model.get_parameter(named[0][0]).any()
    engine.load_weights(model.named_parameters(), version=6)  # restore for the other tests
    with pytest.raises(MilesError, match="not in the transformer"):
        engine.load_weights([("nope.weight", torch.zeros(1))], version=7)


def test_verifier_and_diversity():
    red = shapes.draw("red", "square", 6, 8, 8, 16)
    assert shapes.colour_reward(red, "red") == 1.0 and shapes.colour_reward(red, "blue") == 0.0
    assert shapes.dominant_colour(torch.zeros(3, 16, 16)) is None
    assert shapes.dominant_colour(shapes.draw("cyan", "circle", 6, 5, 9, 16)) == "cyan"
    same = torch.stack([red, red])
    assert shapes.mean_pairwise_distance(same) == 0.0
    moved = torch.stack([red, shapes.draw("red", "square", 6, 4, 4, 16)])
    assert shapes.mean_pairwise_distance(moved) > 0.1
    images, caps = shapes.dataset(200, __import__("random").Random(0), ["red", "blue"], ["square"], 16, 0.5)
    wrong = sum(shapes.colour_reward(img, c.split()[1]) == 0.0 for img, c in zip(images, caps))
    assert 60 < wrong < 140  # about half the captions name the other colour


def test_env_tasks_and_reward(parts):
    env = parts[0]
    assert [t.prompt for t in env.tasks("train")] == ["a red square", "a blue square"]
    ev = env.tasks("eval")
    assert len(ev) == 4 and len({t.metadata["noise_seed"] for t in ev}) == 2
    with pytest.raises(MilesError, match="scores images"):
        env.reward(__import__("miles").Sample(task=ev[0]))
    held = ShapesEnv(ShapesEnvConfig(colours=["red", "blue"], shapes=["square"], held_out=["a blue square"]))
    assert [t.prompt for t in held.tasks("train")] == ["a red square"]
    assert [t.metadata["held_out"] for t in held.tasks("eval")] == [False] * 4 + [True] * 4
    with pytest.raises(ValidationError, match="env.held_out"):
        ShapesEnvConfig(held_out=["a mauve square"])
    with pytest.raises(ValidationError, match="every prompt"):
        ShapesEnvConfig(colours=["red"], shapes=["square"], held_out=["a red square"])


def test_config_errors(tmp_path):
    with pytest.raises(ValidationError, match="unknown"):
        ShapesEnvConfig(colours=["mauve"])
    with pytest.raises(ValidationError, match="not a folder"):
        DiffusersModelConfig(path=str(tmp_path / "missing"))
    with pytest.raises(ValidationError, match="multiple of the patch size"):
        DiffusersModelConfig(image_size=10, transformer={"patch_size": 4})
    with pytest.raises(ValidationError):
        DiffusersEngineConfig(num_step=3)
    with pytest.raises(MilesError, match="needs a tokenizer"):
        DiffusersSpec(DiffusersModelConfig()).build_tokenizer(None)
    with pytest.raises(MilesError, match="model.transformer"):
        spec = DiffusersSpec(DiffusersModelConfig(transformer={"bogus": 1}))
        spec.build_model(ShapesEnv(ShapesEnvConfig()).tokenizer())
    with pytest.raises(MilesError, match="model.name: diffusers"):
        DiffusersEngine(DiffusersEngineConfig(), spec=object(), tokenizer=None)
    with pytest.raises(MilesError, match="engine.name: diffusers"):
        DiffusionRollout().generate([Task("a red square")], 1, engine=object(), params=SamplingParams())


def test_export_folder_loads_in_diffusers(parts, tmp_path):
    from diffusers import SD3Transformer2DModel

    _, spec, tok, engine = parts
    spec.save_pretrained(engine.model.state_dict().items(), tok, str(tmp_path))  # as the trainer names them
    loaded = SD3Transformer2DModel.from_pretrained(tmp_path / "transformer")
    assert all(torch.equal(p, loaded.get_parameter(n)) for n, p in engine.model.named_parameters())
    again = DiffusersSpec(DiffusersModelConfig(path=str(tmp_path)))
    tok2 = again.build_tokenizer(None)
    assert tok2("a red square")["input_ids"] == tok("a red square")["input_ids"]
    e2 = DiffusersEngine(DiffusersEngineConfig(num_steps=4), spec=again, tokenizer=tok2)
    ids = engine.encode(["a red square"])
    a = engine.sample(ids, [3], stochastic=False)["images"]
    b = e2.sample(ids, [3], stochastic=False)["images"]
    assert torch.allclose(a, b, atol=1e-5)  # the reloaded text encoder may pick another attention kernel


def test_miles_reward_hooks_score_image_samples(parts):
    from miles import hookimpl, make_plugin_manager
    from miles.rollouts import RolloutService

    class Brightness:  # a user's reward plugin: reads the decoded image like any sample field
        @hookimpl
        def miles_reward(self, sample):
            return float(sample.extensions["diffusers"]["image"].mean())

    env, _, tok, engine = parts
    pm = make_plugin_manager()
    pm.register(Brightness())
    service = RolloutService(pm, DiffusionRollout(), engine, env, tok, algorithm=None)
    groups = service.run(env.tasks("train"), 2, SamplingParams(seed=3))
    for s in (s for g in groups for s in g.samples):
        assert s.reward == pytest.approx(float(s.extensions["diffusers"]["image"].mean()))


def test_sampler_encodes_a_prompt_once_and_evaluations_keep_only_final_latents(parts):
    """The frozen text encoder's outputs are kept per prompt (``engine.prompt_cache``): a repeated
    prompt is not encoded again and gets the same states as a fresh engine computes; without the
    trajectory (evaluations) the images are those of the full sampler."""
    _, spec, tok, engine = parts
    calls = []
    hook = engine.encoder.register_forward_hook(lambda mod, args, kwargs_out: calls.append(1))
    try:
        ids = engine.encode(["a red square", "a blue square", "a red square"])
        full = engine.sample(ids, [5, 6, 7], stochastic=False)
        n = len(calls)
        last = engine.sample(ids[::-1], [7, 6, 5], stochastic=False, trajectory=False)
        assert len(calls) == n  # every prompt was kept: no encoder call
    finally:
        hook.remove()
    assert torch.equal(last["images"], full["images"].flip(0)) and torch.equal(last["embeds"], full["embeds"].flip(0))
    assert full["latents"].shape[1] == 5 and torch.equal(last["latents"][:, 0], full["latents"][:, -1].flip(0))
    assert last["sigmas"].shape == (3, 5)
    fresh = DiffusersEngine(DiffusersEngineConfig(num_steps=4, prompt_cache=0), spec=spec, tokenizer=tok)
    again = fresh.sample(ids, [5, 6, 7], stochastic=False)
    assert not fresh._cond  # cache 0: nothing kept
    # the same states up to the encoder's rounding in another batch (the kept ones came from earlier batches)
    torch.testing.assert_close(again["embeds"], full["embeds"], rtol=0, atol=1e-5)
    torch.testing.assert_close(again["images"], full["images"], rtol=0, atol=1e-4)
    evals = [s for g in _rollout(parts, SamplingParams(temperature=0.0), n=1, split="eval") for s in g]
    ext = evals[0].extensions["diffusers"]
    assert ext["latents"].shape == (1, 3, 8, 8) and len(evals[0].loss_mask) == 4


def test_cuda_graphs_key_is_accepted_and_ignored_on_cpu(parts):
    """``engine.cuda_graphs`` (on by default) captures nothing on the CPU: the engine samples as
    one built with the key off, bit for bit, ODE and SDE, with and without guidance."""
    _, spec, tok, _ = parts
    ids = [[int(i) for i in row] for row in parts[3].encode(["a red square", "a blue square"])]
    for guidance in (1.0, 2.5):
        on, off = (DiffusersEngine(DiffusersEngineConfig(num_steps=3, guidance_scale=guidance, cuda_graphs=flag),
                                   spec=spec, tokenizer=tok) for flag in (True, False))
        assert on.cfg.cuda_graphs and on._graphs is None and off._graphs is None
        for stochastic in (False, True):
            a, b = (e.sample(ids, [3, 4], stochastic, step_seed=9) for e in (on, off))
            assert torch.equal(a["images"], b["images"]) and torch.equal(a["latents"], b["latents"])
            assert (a["logprobs"] is None) == (not stochastic)
            if stochastic:
                assert torch.equal(a["logprobs"], b["logprobs"])
    with pytest.raises(ValidationError, match="cuda_graphs"):
        DiffusersEngineConfig(cuda_graphs="sometimes")
