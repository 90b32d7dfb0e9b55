"""Typed settings of the diffusers plugin's components (each gets only its own section)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WarmStartConfig(Strict):
    """Flow-matching pretraining of the transformer on the synthetic shapes set, when it is built."""

    steps: int = Field(400, ge=1, description="optimizer steps of flow-matching training")
    batch_size: int = Field(64, ge=1, description="images per step")
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate (cosine-decayed to 5%)")
    caption_noise: float = Field(0.4, ge=0, lt=1, description="share of images whose caption names a "
                                 "wrong colour, so the pretrained model only partly follows prompts")
    seed: int = Field(0, description="seed of the data and of the training noise")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="where the warm start "
                        "trains (cpu, cuda or cuda:N); the weights come back to the CPU after it")
    vae_steps: int = Field(300, ge=0, description="autoencoder (reconstruction) steps before the "
                           "transformer's, when model.vae is set; the VAE's shift_factor and "
                           "scaling_factor are then set so its latents have mean 0 and variance 1")


class DiffusersModelConfig(Strict):
    path: str | None = Field(None, description="local diffusers-style folder with transformer/, "
                             "text_encoder/ and tokenizer/ subfolders (as written by miles export)")
    image_size: int = Field(8, ge=4, description="image side in pixels")
    vae: dict[str, Any] | None = Field(None, description="latent space: AutoencoderKL arguments over the "
                                       "tiny defaults (latent_channels 4, block_out_channels [32, 32], i.e. "
                                       "2x downsampling); the transformer denoises its latents and images "
                                       "are decoded for rewards and grids. null = pixel space (no VAE)")
    transformer: dict[str, Any] = Field(default_factory=dict, description="SD3Transformer2DModel "
                                        "arguments over the tiny defaults (num_layers 2, 2 heads of 32, "
                                        "patch_size 2)")
    text_hidden: int = Field(32, ge=8, description="width of the random CLIP text encoder")
    text_layers: int = Field(1, ge=1, description="layers of the random CLIP text encoder")
    max_length: int = Field(8, ge=3, description="prompt tokens (padded/truncated, with bos and eos)")
    seed: int = Field(0, description="seed of the random initial weights (transformer and text encoder)")
    warm_start: WarmStartConfig | None = Field(None, description="flow-matching pretraining on the "
                                               "synthetic shapes set when the model is built")

    @model_validator(mode="after")
    def _check(self):
        if self.path is not None and not Path(self.path).is_dir():
            raise ValueError(f"model.path {self.path} is not a folder; give a folder written by "
                             f"miles export, or leave model.path out for an inline config")
        if self.path is None:
            patch, factor = int(self.transformer.get("patch_size", 2)), vae_factor(self.vae)
            if self.image_size % (patch * factor):
                raise ValueError(f"model.image_size {self.image_size} must be a multiple of the patch size "
                                 f"({patch}) times the VAE's downsampling ({factor})")
        return self


VAE_DEFAULTS: dict[str, Any] = {"latent_channels": 4, "block_out_channels": [32, 32], "layers_per_block": 1,
                                "norm_num_groups": 8, "scaling_factor": 1.0, "shift_factor": 0.0}


def vae_config(vae: dict[str, Any], image_size: int) -> dict[str, Any]:
    """AutoencoderKL arguments: ``vae`` over the tiny defaults, one down/up block per width, RGB."""
    cfg = {**VAE_DEFAULTS, **vae}
    depth = len(cfg["block_out_channels"])
    cfg.setdefault("down_block_types", ["DownEncoderBlock2D"] * depth)
    cfg.setdefault("up_block_types", ["UpDecoderBlock2D"] * depth)
    cfg.update(in_channels=3, out_channels=3, sample_size=image_size)
    return cfg


def vae_factor(vae: dict[str, Any] | None) -> int:
    """How many pixels per latent along a side: 2 per down block after the first (1 without a VAE)."""
    if vae is None:
        return 1
    return 2 ** (len({**VAE_DEFAULTS, **vae}["block_out_channels"]) - 1)


class DiffusersEngineConfig(Strict):
    num_steps: int = Field(10, ge=1, description="denoising steps")
    eta: float = Field(0.7, gt=0, description="noise level of the SDE sampler (Flow-GRPO's eta)")
    guidance_scale: float = Field(1.0, ge=1.0, description="classifier-free guidance (1 = off)")
    image_size: int | None = Field(None, ge=4, description="image side; null = the model's")
    shift: float = Field(3.0, gt=0, description="timestep shift of the flow-matching schedule")
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    prompt_cache: int = Field(1024, ge=0, description="prompts whose (frozen) text-encoder outputs the "
                              "engine keeps, so a repeated prompt is not encoded again; 0 = encode "
                              "every call")
    cuda_graphs: bool = Field(True, description="on CUDA, each denoising step's transformer call is "
                              "captured once per batch shape into a CUDA graph and replayed (the 4 "
                              "most recent shapes kept): sampling is launch-bound at small shapes; the "
                              "samples equal the eager ones. Ignored on CPU")


class DiffusionRolloutConfig(Strict):
    """Settings of ``rollout.name: diffusion`` (beside the kernel's rollout keys)."""

    samples_dir: str | None = Field(None, description="folder for the evaluation image grids "
                                    "(step_NNNNNN.png); null = <run.out_dir>/samples")
    grid_columns: int = Field(8, ge=1, description="images per row of a grid")
    sampler: Literal["sde", "ode"] = Field("sde", description="training rollouts' sampler: sde (per-step "
                                          "log-probs, for flow-grpo) or ode (deterministic steps from "
                                          "random noise, no log-probs, e.g. for diffusion-nft)")


class ShapesEnvConfig(Strict):
    colours: list[str] = Field(["red", "green", "blue", "yellow"],
                               description="prompt colours (names from the env's palette)")
    shapes: list[str] = Field(["square", "circle"], description="prompt shapes: square, circle")
    eval_images: int = Field(4, ge=2, description="evaluation images per prompt (fixed noise seeds); "
                             "eval_diversity is their mean pairwise distance")
    min_pixels: int = Field(3, ge=1, description="coloured pixels an image needs to count as a shape")
    held_out: list[str] = Field([], description="prompts (e.g. 'a red circle') left out of the train "
                                "tasks; evaluation covers every prompt and also logs their accuracy "
                                "as eval_held_out_accuracy")

    @model_validator(mode="after")
    def _check(self):
        from .shapes import PALETTE, SHAPES, caption

        bad = [c for c in self.colours if c not in PALETTE] + [s for s in self.shapes if s not in SHAPES]
        if bad:
            raise ValueError(f"env.colours/env.shapes: unknown {bad}; colours: {sorted(PALETTE)}, "
                             f"shapes: {list(SHAPES)}")
        prompts = {caption(c, s) for c in self.colours for s in self.shapes}
        unknown = [p for p in self.held_out if p not in prompts]
        if unknown or (prompts and prompts <= set(self.held_out)):
            raise ValueError(f"env.held_out: {unknown or 'every prompt'} is not a held-out subset of "
                             f"the prompts {sorted(prompts)}")
        return self


def cross_section_problems(config: Any) -> list[str]:
    """Sections that select one diffusion component but not the others it needs."""
    model, engine, rollout, env = (_model_name(config), config.name("engine"), config.rollout.name,
                                   config.name("env"))
    problems = []
    if rollout == "diffusion" and engine != "diffusers":
        problems.append(f"engine.name: rollout.name diffusion samples images through engine.name "
                        f"diffusers, not {engine!r}")
    if engine == "diffusers" and model != "diffusers":
        problems.append(f"model.name: engine.name diffusers needs model.name diffusers (or lora with "
                        f"model.base.name diffusers), not {model!r}")
    if engine == "diffusers" and rollout != "diffusion":
        problems.append(f"rollout.name: engine.name diffusers generates images: set rollout.name "
                        f"diffusion (not {rollout!r})")
    if env == "shapes" and engine != "diffusers":
        problems.append(f"env.name: env shapes scores images: set engine.name diffusers (not {engine!r})")
    return problems


def _model_name(config: Any) -> str | None:
    """The model spec's name; for a spec wrapping another (``lora``'s ``model.base``), the wrapped one's."""
    name = config.name("model")
    base = getattr(config.settings("model"), "base", None)
    if isinstance(base, dict):
        return base.get("name", "hf")
    return name
