"""Supervised flow-matching pretraining on the synthetic shapes set (a base model to start RL from)."""
from __future__ import annotations

import math
import random
from typing import Any, Callable

import torch

from . import shapes, text
from .config import ShapesEnvConfig, WarmStartConfig


def flow_matching_loss(model: torch.nn.Module, x0: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor,
                       gen: torch.Generator, shift: float = 3.0) -> torch.Tensor:
    """MSE between the predicted and the true velocity ``noise - x0`` at random noise levels
    (shifted like the sampler's schedule, so training covers the sigmas sampling visits)."""
    u = torch.rand(x0.shape[0], generator=gen).to(x0.device)  # drawn on the CPU: any device, same data
    sigma = shift * u / (1 + (shift - 1) * u)
    noise = torch.randn(x0.shape, generator=gen).to(x0.device)
    s = sigma.view(-1, 1, 1, 1)
    x = (1 - s) * x0 + s * noise
    v = model(hidden_states=x, encoder_hidden_states=embeds, pooled_projections=pooled,
              timestep=sigma * 1000, return_dict=False)[0]
    return ((v - (noise - x0)) ** 2).mean()


def pretrain(model: torch.nn.Module, encoder: torch.nn.Module, tokenizer: Any, cfg: WarmStartConfig,
             image_size: int, max_length: int,
             to_model_space: Callable[[torch.Tensor], torch.Tensor] = lambda images: images * 2 - 1
             ) -> list[float]:
    """Train ``model`` in place on images mapped by ``to_model_space`` (pixels in [-1, 1], or a
    VAE's latents); returns the loss of every step."""
    world = ShapesEnvConfig()
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    prompts = [shapes.caption(c, s) for c in world.colours for s in world.shapes]
    ids = torch.tensor(text.encode(tokenizer, prompts, max_length), device=next(encoder.parameters()).device)
    dev = torch.device(cfg.device)
    all_embeds, all_pooled = (t.to(dev) for t in text.embed(encoder, ids, tokenizer.pad_token_id))
    row = {p: i for i, p in enumerate(prompts)}
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(k, cfg.steps) / cfg.steps)))
    losses = []
    model.train()
    for _ in range(cfg.steps):
        images, captions = shapes.dataset(cfg.batch_size, rng, world.colours, world.shapes, image_size,
                                          cfg.caption_noise)
        idx = torch.tensor([row[c] for c in captions], device=dev)
        loss = flow_matching_loss(model, to_model_space(images.to(dev)), all_embeds[idx], all_pooled[idx], gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.to("cpu")
    return losses


def pretrain_vae(vae: torch.nn.Module, cfg: WarmStartConfig, image_size: int, kl_weight: float = 1e-3
                 ) -> list[float]:
    """Train an ``AutoencoderKL`` in place to reconstruct the shapes set (MSE plus a small KL to
    N(0, 1), per latent element), then set its ``shift_factor`` and ``scaling_factor`` so the latents
    have zero mean and unit variance, as the flow-matching noise does. Returns the loss of every step."""
    world = ShapesEnvConfig()
    rng, gen = random.Random(cfg.seed + 1), torch.Generator().manual_seed(cfg.seed + 1)
    dev = torch.device(cfg.device)
    vae.to(dev)
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    vae.train()
    for _ in range(cfg.vae_steps):
        images, _ = shapes.dataset(cfg.batch_size, rng, world.colours, world.shapes, image_size, 0.0)
        x = images.to(dev) * 2 - 1
        post = vae.encode(x).latent_dist
        z = post.sample(generator=gen)
        loss = ((vae.decode(z).sample - x) ** 2).mean() + kl_weight * post.kl().mean() / z[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    vae.eval()
    with torch.no_grad():
        images, _ = shapes.dataset(256, rng, world.colours, world.shapes, image_size, 0.0)
        z = vae.encode(images.to(dev) * 2 - 1).latent_dist.mode()
    vae.to("cpu")
    vae.register_to_config(scaling_factor=1.0 / max(float(z.std()), 1e-6), shift_factor=float(z.mean()))
    return losses
