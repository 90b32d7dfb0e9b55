"""Latent space (model.vae): the transformer denoises AutoencoderKL latents, images are decoded
for the verifier and grids, the trainer's log-probs equal the rollout's, the export has vae/."""
import json
from pathlib import Path

import pytest
import torch
from miles import MilesError, SamplingParams
from miles.cli import main
from miles_plugin_diffusers.config import DiffusersEngineConfig, DiffusersModelConfig, ShapesEnvConfig
from miles_plugin_diffusers.engine import DiffusersEngine
from miles_plugin_diffusers.env import ShapesEnv
from miles_plugin_diffusers.rollout import DiffusionRollout, stack_trajectories
from miles_plugin_diffusers.spec import DiffusersSpec, trajectory_logprobs
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[4]
MODEL = {"image_size": 16, "vae": {"block_out_channels": [16, 16]}, "transformer": {"num_layers": 1},
         "warm_start": {"steps": 2, "vae_steps": 3, "batch_size": 8}}


@pytest.fixture(scope="module")
def parts():
    env = ShapesEnv(ShapesEnvConfig(colours=["red", "blue"], shapes=["square"], eval_images=2))
    spec = DiffusersSpec(DiffusersModelConfig(**MODEL))
    tok = spec.build_tokenizer(env.tokenizer())
    engine = DiffusersEngine(DiffusersEngineConfig(num_steps=3), spec=spec, tokenizer=tok)
    return env, spec, tok, engine


def test_latent_trajectories_decode_to_images_and_rescore_exactly(parts):
    env, spec, tok, engine = parts
    assert len(spec.vae_losses) == 3 and len(spec.warm_losses) == 2  # both warm starts ran
    assert spec.vae().config.scaling_factor != 1.0  # set from the trained latents' spread
    assert spec.transformer_config()["in_channels"] == 4 and spec.vae_factor() == 2
    groups = DiffusionRollout().generate(env.tasks("train"), 2, engine=engine, env=env, tokenizer=tok,
                                         params=SamplingParams(seed=5))
    samples = [s for g in groups for s in g]
    ext = samples[0].extensions["diffusers"]
    assert ext["latents"].shape == (4, 4, 8, 8)  # T+1 steps of 4 latent channels at 16 / 2
    assert ext["image"].shape == (3, 16, 16) and 0 <= float(ext["image"].min()) <= float(ext["image"].max()) <= 1
    # the image is the VAE's decoding of the last latents
    torch.testing.assert_close(ext["image"], spec.decode(ext["latents"][-1:])[0])
    lp = trajectory_logprobs(spec.build_model(tok), stack_trajectories(samples), torch.ones(len(samples), 3))
    assert torch.equal(lp.detach(), torch.tensor([s.logprobs for s in samples]))


def test_export_includes_the_vae_and_reloads(parts, tmp_path):
    from diffusers import AutoencoderKL

    _, spec, tok, engine = parts
    spec.save_pretrained(engine.model.state_dict().items(), tok, str(tmp_path))
    vae = AutoencoderKL.from_pretrained(tmp_path / "vae")
    assert vae.config.scaling_factor == spec.vae().config.scaling_factor
    again = DiffusersSpec(DiffusersModelConfig(path=str(tmp_path)))
    tok2 = again.build_tokenizer(None)
    e2 = DiffusersEngine(DiffusersEngineConfig(num_steps=3), spec=again, tokenizer=tok2)
    assert e2.image_size == 16 and e2.latent_size == 8
    ids = engine.encode(["a red square"])
    a, b = engine.sample(ids, [3], stochastic=False)["images"], e2.sample(ids, [3], stochastic=False)["images"]
    assert torch.allclose(a, b, atol=1e-5)


def test_latent_config_errors():
    with pytest.raises(ValidationError, match="VAE's downsampling"):
        DiffusersModelConfig(image_size=12, vae={"block_out_channels": [8, 8, 8]})
    spec = DiffusersSpec(DiffusersModelConfig(image_size=16, vae={"bogus": 1}))
    with pytest.raises(MilesError, match="model.vae"):
        spec.vae()


def test_a_few_flow_grpo_steps_in_latent_space(tmp_path):
    out = tmp_path / "run"
    recipe = ROOT / "recipes" / "diffusion_quickstart.yaml"
    assert main(["train", str(recipe), f"run.out_dir={out}", "loggers=[]", "model.image_size=16",
                 "model.vae={block_out_channels: [16, 16]}", "model.transformer={num_layers: 1}",
                 "model.warm_start={steps: 20, vae_steps: 20, batch_size: 16}", "env.colours=[red, blue]",
                 "env.shapes=[square]", "env.eval_images=2", "rollout.batch_size=2", "rollout.n=4",
                 "engine.num_steps=3", "algorithm.filter_zero_variance=false", "run.steps=2",
                 "run.eval_every=2", "run.checkpoint_every=2"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train_rollout_logprob_abs_diff"] == 0.0 for r in rows[1:])
    from PIL import Image

    assert Image.open(out / "samples" / "step_000002.png").size[1] >= 16  # decoded 16x16 images
    assert main(["export", str(out), "--to", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "vae" / "config.json").is_file()
