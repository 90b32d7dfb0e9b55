"""DiffusionNFT (Zheng et al., arXiv 2509.16117): online RL for flow-matching models on the
forward (noising) process.

Rollouts are clean images from any sampler; no log-probs. Each image's reward becomes an
optimality probability ``r = 1/2 + 1/2 clip((reward - group mean) / Z, -1, 1)``. Training noises
each clean sample ``x0`` to ``x_t = (1 - sigma) x0 + sigma * eps`` (the sampler's rectified-flow
convention: the velocity target is ``eps - x0``) and compares two implicit policies built from the
trained velocity ``v`` and the frozen old policy's ``v_old``:

    v+ = (1 - beta) v_old + beta v        v- = (1 + beta) v_old - beta v
    loss = r ||v+ - target||^2 + (1 - r) ||v- - target||^2

so good images pull ``v`` toward their flow-matching target and bad ones push it away, with the
old policy as the anchor. The model spec scores the batch (``extras["x_t"]``: the ``diffusers``
spec's forward-process scoring returns ``v`` and ``v_old``, the old policy an EMA of the weights).
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Sequence

import torch
from miles import Batch, Group, MilesError, Sample
from miles_rlmath import masked_mean

from .config import DiffusionNFTConfig


def optimality(rewards: Sequence[float], z: float | None = None) -> list[float]:
    """Rewards -> optimality probabilities in [0, 1]: centred on their mean, divided by ``z``
    (default: their population std), clipped to [-1, 1], mapped to [0, 1]. Equal rewards give 1/2."""
    mean = sum(rewards) / len(rewards)
    z = statistics.pstdev(rewards) if z is None else z
    if z <= 1e-8:
        return [0.5] * len(rewards)
    return [0.5 + 0.5 * max(-1.0, min(1.0, (x - mean) / z)) for x in rewards]


def implicit_policies(v: torch.Tensor, v_old: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The implicit positive and negative velocities ``(v+, v-)``."""
    return (1 - beta) * v_old + beta * v, (1 + beta) * v_old - beta * v


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, r: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-draw loss ``r * mse(v+) + (1 - r) * mse(v-)``, and the two squared errors, each the
    mean over the last dimension: ``v``/``v_old``/``target`` ``[..., D]``, ``r`` ``[...]``."""
    pos, neg = implicit_policies(v, v_old.detach(), beta)
    pos_err, neg_err = ((pos - target) ** 2).mean(-1), ((neg - target) ** 2).mean(-1)
    return r * pos_err + (1 - r) * neg_err, pos_err, neg_err


class DiffusionNFT:
    uses_rollout = True
    needs_reference = False
    needs_critic = False

    def __init__(self, cfg: DiffusionNFTConfig | None = None):
        self.cfg = cfg or DiffusionNFTConfig()

    def keep(self, group: Group) -> bool:
        r = group.rewards
        return not (self.cfg.filter_zero_variance and len(r) > 1 and all(x == r[0] for x in r))

    def advantages(self, groups: Sequence[Group]) -> list[list[float]]:
        """Per image, its optimality probability r (the loss's weight of the positive policy)."""
        z = None
        if self.cfg.reward_norm == "batch":
            z = statistics.pstdev([x for g in groups for x in g.rewards])
        return [optimality(g.rewards, z) for g in groups]

    def make_batch(self, samples: Sequence[Sample], pad_id: int = 0, advantages: Sequence[Any] | None = None) -> Batch:
        """A non-token batch of ``K = noise_draws`` forward-process draws per image: ``loss_mask``
        and ``advantages`` (r) are ``[B, K]``; ``extras`` holds ``x_t`` ``[B, K, C, h, w]``,
        ``sigma_t`` ``[B, K]``, ``v_target``, the conditioning and the old policy's EMA decay."""
        key, K = self.cfg.trajectory_key, self.cfg.noise_draws
        if not samples or any(key not in s.extensions or "latents" not in s.extensions[key] for s in samples):
            raise MilesError(f"algorithm 'diffusion-nft': a sample has no extensions[{key!r}] with final "
                             f"latents; use rollout.name: diffusion (or set algorithm.trajectory_key)")
        x0 = torch.stack([s.extensions[key]["latents"][-1] for s in samples]).float()
        B = x0.shape[0]
        # one generator per weight version: the same draws when a step is redone after a resume
        version = max(int(s.weight_version) for s in samples)
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + version)
        u = torch.rand(B, K, generator=g)
        sigma = self.cfg.shift * u / (1 + (self.cfg.shift - 1) * u)
        eps = torch.randn((B, K, *x0.shape[1:]), generator=g)
        s = sigma.view(B, K, *[1] * (x0.ndim - 1))
        x_t = (1 - s) * x0[:, None] + s * eps
        r = torch.tensor([float(a) for a in (advantages if advantages is not None else [0.5] * B)])
        mask = torch.ones(B, K)
        extras: dict[str, Any] = {"x_t": x_t, "sigma_t": sigma, "v_target": eps - x0[:, None],
                                  "old_decay": self.cfg.ema_decay}
        for name in ("embeds", "pooled"):
            extras[name] = torch.stack([smp.extensions[key][name] for smp in samples])
        # no per-step log-probs travel: the kernel's train/rollout log-prob comparison is skipped
        bare = [dataclasses.replace(smp, logprobs=[], loss_mask=[]) for smp in samples]
        return Batch(input_ids=None, attention_mask=None, position_ids=None, prompt_len=0, loss_mask=mask,
                     advantages=r[:, None] * mask, rollout_logprobs=torch.zeros(B, K),
                     rewards=torch.tensor([float(smp.reward or 0.0) for smp in samples]), samples=bare,
                     global_tokens=float(B * K), global_samples=B, extras=extras)

    def loss(self, batch: Batch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """``logprobs``: the spec's forward-process scores ``[B, 2 * K * D]`` (``v``, then ``v_old``)."""
        B, K = batch.loss_mask.shape
        target = batch.extras["v_target"].reshape(B, K, -1).to(logprobs.device)
        D = target.shape[-1]
        if logprobs.shape != (B, 2 * K * D):
            raise MilesError(f"algorithm 'diffusion-nft' needs the model spec's forward-process velocities "
                             f"[B, 2*K*D] = {[B, 2 * K * D]}, got {list(logprobs.shape)}: use model.name "
                             f"diffusers (or lora over it)")
        v, v_old = logprobs.reshape(B, 2, K, D).unbind(1)
        r = batch.advantages.to(logprobs.device)
        per, pos_err, neg_err = nft_loss(v, v_old, target, r, self.cfg.beta)
        loss = batch.token_mean(per)  # this micro-batch's share of the step's mean
        m = batch.loss_mask  # metrics: this micro-batch's own mean (the trainer averages)
        metrics = {"nft_loss": masked_mean(per, m), "nft_pos_mse": masked_mean(pos_err, m),
                   "nft_neg_mse": masked_mean(neg_err, m), "flow_mse": masked_mean(((v - target) ** 2).mean(-1), m),
                   "old_policy_gap": masked_mean(((v - v_old) ** 2).mean(-1), m), "optimality_mean": masked_mean(r, m)}
        return loss, metrics
