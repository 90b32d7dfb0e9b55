"""Engine ``diffusers``: samples images with the SDE (training) or ODE (evaluation) sampler and
records each denoising trajectory: latents, sigmas, per-step log-probs, conditioning (evaluations
ask for the final latents only)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from miles import MilesError
from miles.protocols import DiffusionSpec

from . import sde, text
from .config import DiffusersEngineConfig
from .cudagraphs import VelocityGraphs


class DiffusersEngine:
    def __init__(self, cfg: DiffusersEngineConfig, *, spec: Any, tokenizer: Any, seed: int = 0, **_: Any):
        if not isinstance(spec, DiffusionSpec):
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
        # per-step constants, on the device once: the sampling loop then copies nothing per step
        self._sigmas = self.sigmas.to(self.device)
        self._timesteps = self._sigmas * 1000  # the transformer's timestep, as sde.velocity scales it
        self._dts = self._sigmas[1:] - self._sigmas[:-1]  # the Euler steps' dt (negative)
        self._cond: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}  # see _conditioning
        # the steps' transformer calls as CUDA graphs (cudagraphs.py); eager on the CPU
        graphs = cfg.cuda_graphs and self.device.type == "cuda"
        self._graphs = VelocityGraphs(self.model, self.device) if graphs else None
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
            # in place, never a new tensor: the captured CUDA graphs read these same tensors
            params[name].copy_(t.to(params[name].device, params[name].dtype))
        self.weight_version = version

    # -- sampling ----------------------------------------------------------------------------------
    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        return text.encode(self.tokenizer, prompts, self.max_length)

    @torch.no_grad()
    def sample(self, prompt_ids: Sequence[Sequence[int]], noise_seeds: Sequence[int], stochastic: bool,
               step_seed: int = 0, trajectory: bool = True) -> dict[str, Any]:
        """One image per row. ``noise_seeds``: each row's initial noise (so an ODE sample depends
        only on its prompt, seed and weights); ``step_seed``: the SDE steps' noise of the batch.
        Returns CPU tensors: ``images`` ``[B, 3, H, W]`` in [0, 1] (decoded by the VAE in latent
        space), ``latents`` ``[B, T+1, C, h, w]`` (the transformer's space: pixels or VAE latents;
        ``[B, 1, C, h, w]``, the final ones only, with ``trajectory=False``), ``sigmas`` ``[B, T+1]``,
        ``logprobs`` ``[B, T]`` (None for ODE), ``embeds``, ``pooled`` (``neg_*`` with guidance),
        ``eta``, ``guidance``."""
        dev, B, size = self.device, len(prompt_ids), self.latent_size
        cond, host = {}, {}
        cond["embeds"], cond["pooled"], host["embeds"], host["pooled"] = self._conditioning(prompt_ids)
        g = self.cfg.guidance_scale
        if g > 1.0:
            empty = self.encode([""]) * B
            cond["neg_embeds"], cond["neg_pooled"], host["neg_embeds"], host["neg_pooled"] = self._conditioning(empty)
        # each row's noise from its own seed, drawn on the CPU into one tensor (one copy to the device)
        x, gen_cpu = torch.empty((B, self.channels, size, size)), torch.Generator()
        for i, s in enumerate(noise_seeds):
            torch.randn((self.channels, size, size), generator=gen_cpu.manual_seed(int(s)), out=x[i])
        x = x.to(dev)
        timesteps, dts = self._timesteps.expand(B, -1), self._dts
        lats, lps = [x], []
        if stochastic:
            sig = self._sigmas.expand(B, -1).contiguous()
            gen = torch.Generator(device=dev).manual_seed(int(step_seed))
        velocity = self._velocity(x, cond, g, timesteps[:, 0])
        for t in range(len(self.sigmas) - 1):
            v = velocity(x, timesteps[:, t])  # with graphs, overwritten by the next step's call
            if stochastic:
                x, lp = sde.sde_step(x, v, sig[:, t], sig[:, t + 1], sig[:, 1], self.cfg.eta, gen)
                lps.append(lp)
            else:
                x = sde.ode_step(x, v, dts[t])
            if trajectory:
                lats.append(x)
        out: dict[str, Any] = dict(host)
        out.update(images=self.spec.decode(x).cpu(),
                   latents=torch.stack(lats, 1).cpu() if trajectory else x[:, None].cpu(),
                   sigmas=self.sigmas.expand(B, -1).clone(),
                   logprobs=torch.stack(lps, 1).cpu() if stochastic else None, eta=self.cfg.eta, guidance=g)
        return out

    def _velocity(self, x: torch.Tensor, cond: dict[str, torch.Tensor], guidance: float,
                  timestep: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """One sampling call's step function ``(x, timestep) -> velocity``: a CUDA graph's replay
        (``engine.cuda_graphs`` on CUDA) or the eager transformer call."""
        if self._graphs is not None:
            return self._graphs.bind(x, cond, guidance, timestep)
        return lambda x, timestep: sde.velocity(self.model, x, None, cond, guidance, timestep=timestep)

    def _conditioning(self, prompt_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
        """Text-encoder states of each row: ``embeds`` ``[B, L, D]`` and ``pooled`` ``[B, D]`` on the
        engine's device, then the same on the CPU. The encoder is frozen, so each prompt's states are
        kept (up to ``engine.prompt_cache`` prompts) and a prompt is encoded once: repeated prompts
        (groups, evaluations) cost no encoder call and no copy to the host."""
        keys = [tuple(int(i) for i in p) for p in prompt_ids]
        missing = [k for k in keys if k not in self._cond]
        rows = [self._cond.get(k) for k in keys]
        if missing:  # every row not kept yet (repeats too), encoded as one batch
            ids = torch.tensor(missing, dtype=torch.long, device=self.device)
            batch = text.embed(self.encoder, ids, self.tokenizer.pad_token_id)
            batch = (*batch, batch[0].cpu(), batch[1].cpu())
            fresh = iter(range(len(missing)))
            for i, k in enumerate(keys):
                if rows[i] is None:
                    j = next(fresh)
                    rows[i] = tuple(t[j] for t in batch)
                    if self.cfg.prompt_cache and k not in self._cond:  # a copy: the batch is not kept alive
                        self._cond[k] = tuple(t.clone() for t in rows[i])
            while len(self._cond) > self.cfg.prompt_cache:  # the oldest prompts go first
                self._cond.pop(next(iter(self._cond)))
            if len(missing) == len(keys):
                return batch
        return tuple(torch.stack([r[i] for r in rows]) for i in range(4))
