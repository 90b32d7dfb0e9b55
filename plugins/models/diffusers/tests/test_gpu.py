"""On a CUDA GPU (``pytest -m gpu``): a few Flow-GRPO steps of recipes/diffusion_gpu.yaml (64x64
images in a VAE's latent space, engine and trainer on the GPU) with a shortened warm start;
the trainer's log-probs match the rollout's, the grid and the export (with vae/) are written,
and diffusers' own pipeline samples the same images as miles' ODE sampler from that export."""
import json
from pathlib import Path

import pytest
import torch
from miles.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[4]


def test_gpu_recipe_steps_on_cuda(tmp_path):
    out = tmp_path / "run"
    torch.cuda.reset_peak_memory_stats()
    assert main(["train", str(ROOT / "recipes" / "diffusion_gpu.yaml"), f"run.out_dir={out}", "loggers=[]",
                 "model.warm_start.steps=200", "model.warm_start.vae_steps=100", "run.steps=3",
                 "run.eval_every=3", "run.checkpoint_every=3"]) == 0
    assert torch.cuda.max_memory_allocated() > 100 * 2**20  # the models ran on the GPU
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    diffs = [r["train_rollout_logprob_abs_diff"] for r in rows if "train_rollout_logprob_abs_diff" in r]
    print("MEASURED train_rollout_logprob_abs_diff", diffs)
    assert diffs and max(diffs) < 1e-2  # fp32 on one device (kept groups change the batch shape)
    assert (out / "samples" / "step_000003.png").is_file()
    assert main(["export", str(out), "--to", str(tmp_path / "export")]) == 0

    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from miles_plugin_diffusers.config import DiffusersEngineConfig, DiffusersModelConfig
    from miles_plugin_diffusers.engine import DiffusersEngine
    from miles_plugin_diffusers.spec import DiffusersSpec

    spec = DiffusersSpec(DiffusersModelConfig(path=str(tmp_path / "export")))
    engine = DiffusersEngine(DiffusersEngineConfig(num_steps=8, device="cuda"), spec=spec,
                             tokenizer=spec.build_tokenizer(None))
    assert engine.image_size == 64 and engine.latent_size == 16
    ids = engine.encode(["a red square", "a blue circle"])
    ours = engine.sample(ids, [1, 2], stochastic=False)
    pipe = StableDiffusion3Pipeline(transformer=engine.model, vae=spec.vae().to("cuda"),
                                    scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=None,
                                    tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
                                    tokenizer_3=None)
    theirs = pipe(prompt_embeds=ours["embeds"].cuda(), pooled_prompt_embeds=ours["pooled"].cuda(),
                  num_inference_steps=8, guidance_scale=1.0, height=64, width=64,
                  latents=ours["latents"][:, 0].cuda(), output_type="pt").images
    assert theirs.shape == (2, 3, 64, 64)
    assert float((theirs.float().cpu() - ours["images"]).abs().max()) < 1e-3


def test_old_policy_state_written_on_cpu_resumes_on_cuda():
    """A checkpoint's old-policy state (full CPU tensors) loads onto the model's device: a run
    resumed on a GPU folds the EMA on there as the CPU run would."""
    from miles import Batch, Sample, Task
    from miles_plugin_diffusers.config import DiffusersModelConfig, ShapesEnvConfig
    from miles_plugin_diffusers.env import ShapesEnv
    from miles_plugin_diffusers.spec import DiffusersSpec

    cfg = DiffusersModelConfig(transformer={"num_layers": 1})
    tok = ShapesEnv(ShapesEnvConfig(colours=["red"], shapes=["square"])).tokenizer()
    spec, cpu_model = DiffusersSpec(cfg), DiffusersSpec(cfg).build_model(tok)
    g = torch.Generator().manual_seed(0)
    extras = {"x_t": torch.randn(2, 2, 3, 8, 8, generator=g), "sigma_t": torch.rand(2, 2, generator=g),
              "embeds": torch.randn(2, 5, cfg.text_hidden, generator=g),
              "pooled": torch.randn(2, cfg.text_hidden, generator=g), "old_decay": 0.5}

    def step(s, model, version, device):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9).add_(0.01 * version)
        ex = {k: v.to(device) if torch.is_tensor(v) else v for k, v in extras.items()}
        samples = [Sample(Task("a red square"), weight_version=version)] * 2
        ones = torch.ones(2, 2, device=device)
        return s.action_logprobs(model, Batch(None, None, None, 0, ones, ones, ones * 0, torch.zeros(2),
                                              samples, extras=ex))

    step(spec, cpu_model, 0, "cpu")
    step(spec, cpu_model, 1, "cpu")
    saved = {k: v.clone() for k, v in spec.training_state(cpu_model).items()}
    gpu_spec, gpu_model = DiffusersSpec(cfg), DiffusersSpec(cfg).build_model(tok).cuda()
    gpu_model.load_state_dict(cpu_model.state_dict())
    gpu_spec.load_training_state(gpu_model, saved)
    assert all(p.is_cuda for p in gpu_spec._old.module.parameters()) and gpu_spec._old.version == 1
    on_cpu, on_gpu = step(spec, cpu_model, 2, "cpu"), step(gpu_spec, gpu_model, 2, "cuda")
    assert torch.allclose(on_gpu.cpu(), on_cpu, atol=1e-4)
