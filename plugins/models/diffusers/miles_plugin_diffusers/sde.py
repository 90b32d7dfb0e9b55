"""Flow-matching samplers and the Flow-GRPO SDE transition density (arXiv 2505.05470).

A flow-matching model predicts the velocity ``v`` of ``x_sigma = (1 - sigma) x_0 + sigma * noise``.
The deterministic (ODE) Euler step is ``x' = x + v * dt``; the stochastic (SDE) step with the same
marginals adds Gaussian noise of level ``eta``, which makes every transition a Gaussian whose
log-density the policy gradient needs. The same functions serve the sampler and the trainer, so
a recorded transition's log-prob is recomputed by identical arithmetic.
"""
from __future__ import annotations

import math

import torch

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """The ``num_steps + 1`` sigmas (from 1 down to 0) of diffusers' FlowMatchEulerDiscreteScheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(num_steps)
    return sched.sigmas.to(torch.float32).clone()


def velocity(model: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor | None, cond: dict[str, torch.Tensor],
             guidance: float, timestep: torch.Tensor | None = None) -> torch.Tensor:
    """The model's velocity at ``x`` ``[B, C, H, W]`` and noise level ``sigma`` ``[B]``; with
    ``guidance > 1``, classifier-free guidance against the ``neg_*`` (empty prompt) conditioning.
    ``timestep`` (``sigma * 1000``, the transformer's scale) may be given instead of ``sigma``:
    a sampler computes it once for all steps."""
    if timestep is None:
        timestep = sigma * 1000
    if guidance > 1.0:
        xx = torch.cat([x, x])
        emb = torch.cat([cond["neg_embeds"], cond["embeds"]])
        pooled = torch.cat([cond["neg_pooled"], cond["pooled"]])
        out = model(hidden_states=xx, encoder_hidden_states=emb, pooled_projections=pooled,
                    timestep=torch.cat([timestep, timestep]), return_dict=False)[0]
        v_neg, v_pos = out.chunk(2)
        return v_neg + guidance * (v_pos - v_neg)
    return model(hidden_states=x, encoder_hidden_states=cond["embeds"], pooled_projections=cond["pooled"],
                 timestep=timestep, return_dict=False)[0]


def _bcast(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, 1, 1, 1)


def sde_mean_std(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                 sigma_max: torch.Tensor, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``[B, C, H, W]`` and standard deviation ``[B, 1, 1, 1]`` of the SDE step from ``sigma``
    to ``sigma_next`` (``sigma_max``, the second sigma, stands in for 1 in ``1 - sigma``, which
    would divide by zero at the first step)."""
    s, s_next, s_max = _bcast(sigma), _bcast(sigma_next), _bcast(sigma_max)
    dt = s_next - s
    std_t = torch.sqrt(s / (1 - torch.where(s == 1, s_max, s))) * eta
    mean = x * (1 + std_t ** 2 / (2 * s) * dt) + v * (1 + std_t ** 2 * (1 - s) / (2 * s)) * dt
    return mean, std_t * torch.sqrt(-dt)


def gaussian_logprob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density of ``x_next`` under ``N(mean, std^2)``, averaged over C, H, W: ``[B]``."""
    lp = -((x_next.detach() - mean) ** 2) / (2 * std ** 2) - torch.log(std) - LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             sigma_max: torch.Tensor, eta: float, generator: torch.Generator | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One stochastic step: the next latents and their log-prob ``[B]``."""
    mean, std = sde_mean_std(x, v, sigma, sigma_next, sigma_max, eta)
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    x_next = mean + std * noise
    return x_next, gaussian_logprob(x_next, mean, std)


def ode_step(x: torch.Tensor, v: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """One deterministic Euler step of the probability-flow ODE: ``dt = sigma_next - sigma``, a
    scalar or one per row (``[B, 1, 1, 1]``)."""
    return x + v * dt
