"""Env ``shapes``: prompts naming a colour and a shape; the verifier checks the image's colour."""
from __future__ import annotations

from typing import Any

from miles import MilesError, Sample, Task

from . import shapes, text
from .config import ShapesEnvConfig

EVAL_SEED = 10_000  # eval noise seeds: EVAL_SEED + k for the k-th image of every prompt


class ShapesEnv:
    def __init__(self, cfg: ShapesEnvConfig, seed: int = 0):
        self.cfg, self.seed = cfg, seed

    def _combos(self) -> list[tuple[str, str]]:
        return [(c, s) for c in self.cfg.colours for s in self.cfg.shapes]

    def tasks(self, split: str) -> list[Task]:
        held = set(self.cfg.held_out)
        if split == "train":
            return [Task(shapes.caption(c, s), label=c, metadata={"colour": c, "shape": s}, id=f"{c}-{s}")
                    for c, s in self._combos() if shapes.caption(c, s) not in held]
        return [Task(shapes.caption(c, s), label=c, id=f"eval-{c}-{s}-{k}",
                     metadata={"colour": c, "shape": s, "noise_seed": EVAL_SEED + k,
                               "held_out": shapes.caption(c, s) in held})
                for c, s in self._combos() for k in range(self.cfg.eval_images)]

    def reward(self, sample: Sample) -> float:
        ext = sample.extensions.get("diffusers")
        if ext is None or "image" not in ext:
            raise MilesError("env 'shapes' scores images: use rollout.name: diffusion with engine.name: diffusers")
        return shapes.colour_reward(ext["image"], sample.task.label, self.cfg.min_pixels)

    def tokenizer(self) -> Any:
        return text.word_tokenizer(["a", *shapes.PALETTE, *shapes.SHAPES])
