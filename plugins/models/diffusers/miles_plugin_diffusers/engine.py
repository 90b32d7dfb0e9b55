"""Engine ``diffusers``: samples images with the SDE (training) or ODE (evaluation) sampler and
records each denoising trajectory: latents, sigmas, per-step log-probs, conditioning."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from miles import MilesError

from . import sde, text
from .config import DiffusersEngineConfig


class DiffusersEngine:
    def __init__(self, cfg: DiffusersEngineConfig, *, spec: Any, tokenizer: Any, seed: int = 0, **_: Any):
        if not hasattr(spec, "text_encoder"):
            raise MilesError(f"engine 'diffusers' needs model.name: diffusers (got a {type(spec).__name__})")
        self.cfg, self.spec, self.tokenizer, self.seed = cfg, spec, tokenizer, seed
        self.device = torch.device(cfg.device)
        self.model = spec.build_model(tokenizer).to(self.device).eval().requires_grad_(False)
        self.encoder = spec.text_encoder(tokenizer).to(self.device)
        self.max_length = spec.max_length()
        self.image_size = cfg.image_size or spec.image_size(self.model)
        factor = spec.vae_factor()
        if self.image_size % factor:
            raise MilesError(f"engine.image_size {self.image_size} must be a multiple of the VAE's "
                             f"downsampling ({factor})")
        self.latent_size = self.image_size // factor  # the side of what the transformer denoises
        self.channels = int(self.model.config.in_channels)
        self.sigmas = sde.sigmas(cfg.num_steps, cfg.shift)
        self.weight_version = 0

    # -- the kernel's Engine protocol --------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: Any, n: int = 1) -> list:
        raise MilesError("engine 'diffusers' generates images, not tokens: set rollout.name: diffusion")

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        params.update(self.model.named_buffers())
        for name, t in named_tensors:
            if name not in params:
                raise MilesError(f"engine 'diffusers': weight {name!r} is not in the transformer; the "
                                 f"trainer and engine were built from different model settings")
            params[name].copy_(t.to(params[name].device, params[name].dtype))
        self.weight_version = version

    # -- sampling ----------------------------------------------------------------------------------
    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        return text.encode(self.tokenizer, prompts, self.max_length)

    @torch.no_grad()
    def sample(self, prompt_ids: Sequence[Sequence[int]], noise_seeds: Sequence[int], stochastic: bool,
               step_seed: int = 0) -> dict[str, Any]:
        """One image per row. ``noise_seeds``: each row's initial noise (so an ODE sample depends
        only on its prompt, seed and weights); ``step_seed``: the SDE steps' noise of the batch.
        Returns CPU tensors: ``images`` ``[B, 3, H, W]`` in [0, 1] (decoded by the VAE in latent
        space), ``latents`` ``[B, T+1, C, h, w]`` (the transformer's space: pixels or VAE latents),
        ``sigmas`` ``[B, T+1]``, ``logprobs`` ``[B, T]`` (None for ODE), ``embeds``, ``pooled``
        (``neg_*`` with guidance), ``eta``, ``guidance``."""
        dev, B, size = self.device, len(prompt_ids), self.latent_size
        ids = torch.tensor([list(p) for p in prompt_ids], dtype=torch.long, device=dev)
        embeds, pooled = text.embed(self.encoder, ids, self.tokenizer.pad_token_id)
        cond = {"embeds": embeds, "pooled": pooled}
        g = self.cfg.guidance_scale
        if g > 1.0:
            empty = torch.tensor(self.encode([""]), device=dev).expand(B, -1)
            cond["neg_embeds"], cond["neg_pooled"] = text.embed(self.encoder, empty, self.tokenizer.pad_token_id)
        x = torch.stack([torch.randn((self.channels, size, size), generator=torch.Generator().manual_seed(int(s)))
                         for s in noise_seeds]).to(dev)
        sig = self.sigmas.to(dev).expand(B, -1).contiguous()
        gen = torch.Generator(device=dev).manual_seed(int(step_seed))
        lats, lps = [x], []
        for t in range(len(self.sigmas) - 1):
            v = sde.velocity(self.model, x, sig[:, t], cond, g)
            if stochastic:
                x, lp = sde.sde_step(x, v, sig[:, t], sig[:, t + 1], sig[:, 1], self.cfg.eta, gen)
                lps.append(lp)
            else:
                x = sde.ode_step(x, v, sig[:, t], sig[:, t + 1])
            lats.append(x)
        out = {k: v.cpu() for k, v in cond.items()}
        out.update(images=self.spec.decode(x).cpu(), latents=torch.stack(lats, 1).cpu(),
                   sigmas=sig.cpu(), logprobs=torch.stack(lps, 1).cpu() if stochastic else None,
                   eta=self.cfg.eta, guidance=g)
        return out
