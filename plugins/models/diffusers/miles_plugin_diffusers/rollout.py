"""Rollout ``diffusion``: tasks -> the engine's images -> Samples carrying their trajectories.

A sample's actions are its denoising steps: ``logprobs`` and ``loss_mask`` have one entry per
step, ``response_ids`` is empty, and ``extensions["diffusers"]`` holds the trajectory
(``latents`` ``[T+1, C, H, W]``, ``sigmas`` ``[T+1]``, ``embeds`` ``[L, D]``, ``pooled`` ``[D]``,
``eta``, ``guidance``) and the decoded ``image`` ``[3, H, W]`` in [0, 1] for rewards. Evaluation
samples (temperature 0) keep only the final latents (``latents`` ``[1, C, H, W]``).
"""
from __future__ import annotations

import os
import random
import zlib
from typing import Any, Sequence

import torch
from miles import MilesError, Sample, Task
from miles.protocols import SamplesImages

from . import shapes
from .config import DiffusionRolloutConfig

KEY = "diffusers"
_PER_ROW = ("latents", "sigmas", "embeds", "pooled", "neg_embeds", "neg_pooled")


class DiffusionRollout:
    def __init__(self, cfg: DiffusionRolloutConfig | None = None, out_dir: str | None = None, **_: Any):
        self.cfg = cfg or DiffusionRolloutConfig()
        self.samples_dir = self.cfg.samples_dir or (os.path.join(out_dir, "samples") if out_dir else None)

    def generate(self, tasks: Sequence[Task], n: int, *, engine: Any, env: Any = None, tokenizer: Any = None,
                 params: Any = None) -> list[list[Sample]]:
        if not isinstance(engine, SamplesImages):
            raise MilesError(f"rollout 'diffusion' needs engine.name: diffusers (got {type(engine).__name__})")
        # temperature 0 (evaluation): the ODE sampler from fixed noise; otherwise random noise,
        # through the SDE sampler (per-step log-probs) or, with rollout.sampler ode, the ODE one
        random_noise = params is None or params.temperature > 0
        stochastic = random_noise and self.cfg.sampler == "sde"
        rng = random.Random(params.seed if params is not None and params.seed is not None else 0)
        rows = [(t, j) for t in tasks for j in range(n)]
        if random_noise:
            seeds = [rng.randrange(2**31) for _ in rows]
        else:  # fixed per task, so evaluations at different steps compare the same noise
            seeds = [int(t.metadata.get("noise_seed", zlib.crc32(str(t.id).encode()))) + j for t, j in rows]
        ids = engine.encode([str(t.prompt) for t, _ in rows])
        # evaluations are never trained on: their samples keep the final latents, not the trajectory
        out = engine.sample(ids, seeds, stochastic, step_seed=rng.randrange(2**31), trajectory=random_noise)
        T = out["sigmas"].shape[1] - 1
        samples = []
        for i, (task, _) in enumerate(rows):
            ext = {k: out[k][i] for k in _PER_ROW if k in out}
            ext.update(eta=out["eta"], guidance=out["guidance"], image=out["images"][i], stochastic=stochastic)
            lp = out["logprobs"][i].tolist() if stochastic else [0.0] * T
            samples.append(Sample(task=task, prompt_ids=list(ids[i]), response_ids=[], response="",
                                  logprobs=lp, loss_mask=[1 if stochastic else 0] * T,
                                  weight_version=engine.weight_version, extensions={KEY: ext}))
        if not random_noise and self.samples_dir:
            os.makedirs(self.samples_dir, exist_ok=True)
            path = os.path.join(self.samples_dir, f"step_{engine.weight_version:06d}.png")
            shapes.save_grid(out["images"], path, self.cfg.grid_columns)
        return [samples[i * n:(i + 1) * n] for i in range(len(tasks))]

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """``diversity``: mean pairwise pixel distance among each prompt's images;
        ``held_out_accuracy``: the share of held-out prompts' images that match them."""
        d = shapes.diversity(samples, KEY)
        out = {} if d is None else {"diversity": d}
        held = [s for s in samples if s.task.metadata.get("held_out") and s.reward is not None]
        if held:  # prompts the env kept out of training (env.held_out)
            out["held_out_accuracy"] = sum(s.reward >= 1.0 for s in held) / len(held)
        return out


def stack_trajectories(samples: Sequence[Sample]) -> dict[str, Any]:
    """The samples' trajectories as batch tensors (``B`` first), for ``Batch.extras``."""
    first = samples[0].extensions.get(KEY)
    if first is None:
        raise MilesError("a diffusion batch needs samples from rollout.name: diffusion")
    extras: dict[str, Any] = {k: torch.stack([s.extensions[KEY][k] for s in samples])
                              for k in _PER_ROW if k in first}
    extras.update(eta=first["eta"], guidance=first["guidance"])
    return extras
