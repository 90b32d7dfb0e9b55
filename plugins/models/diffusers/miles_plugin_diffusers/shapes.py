"""The synthetic shapes world: coloured shapes on black, a pixel verifier, sloppy captions.

Images are ``[3, H, W]`` floats in [0, 1]. The verifier needs no model: a pixel is foreground
when its brightest channel exceeds 0.5, its colour is the palette entry of its thresholded
channels, and an image matches its prompt when the prompt's colour is the foreground's most
common colour.
"""
from __future__ import annotations

import random
from typing import Any, Sequence

import torch

PALETTE = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1),
           "yellow": (1, 1, 0), "magenta": (1, 0, 1), "cyan": (0, 1, 1), "white": (1, 1, 1)}
SHAPES = ("square", "circle")
_CODE = {rgb: name for name, rgb in PALETTE.items()}


def caption(colour: str, shape: str) -> str:
    return f"a {colour} {shape}"


def draw(colour: str, shape: str, size: int, cx: float, cy: float, image_size: int) -> torch.Tensor:
    """One shape of side/diameter ``size`` centred at (cx, cy), on black."""
    ys, xs = torch.meshgrid(torch.arange(image_size) + 0.5, torch.arange(image_size) + 0.5, indexing="ij")
    if shape == "square":
        inside = ((xs - cx).abs() <= size / 2) & ((ys - cy).abs() <= size / 2)
    else:
        inside = (xs - cx) ** 2 + (ys - cy) ** 2 <= (size / 2) ** 2
    rgb = torch.tensor(PALETTE[colour], dtype=torch.float32).view(3, 1, 1)
    return rgb * inside.float()


def random_image(rng: random.Random, colours: Sequence[str], shapes: Sequence[str],
                 image_size: int) -> tuple[torch.Tensor, str, str]:
    colour, shape = rng.choice(list(colours)), rng.choice(list(shapes))
    size = rng.randint(max(2, image_size // 4), max(3, image_size // 2))
    lo, hi = size / 2, image_size - size / 2
    img = draw(colour, shape, size, rng.uniform(lo, hi), rng.uniform(lo, hi), image_size)
    return img, colour, shape


def dataset(count: int, rng: random.Random, colours: Sequence[str], shapes: Sequence[str],
            image_size: int, caption_noise: float) -> tuple[torch.Tensor, list[str]]:
    """``count`` images ``[N, 3, H, W]`` in [0, 1] and their captions; a ``caption_noise`` share of
    the captions names another colour than the image shows."""
    images, captions = [], []
    for _ in range(count):
        img, colour, shape = random_image(rng, colours, shapes, image_size)
        if rng.random() < caption_noise:
            colour = rng.choice([c for c in colours if c != colour])
        images.append(img)
        captions.append(caption(colour, shape))
    return torch.stack(images), captions


def dominant_colour(image: torch.Tensor, min_pixels: int = 3) -> str | None:
    """The most common palette colour among the foreground pixels, or None without a shape."""
    bits = (image.clamp(0, 1) > 0.5).to(torch.int64)  # [3, H, W]
    fg = bits.sum(0) > 0
    if int(fg.sum()) < min_pixels:
        return None
    codes = (bits[0] * 4 + bits[1] * 2 + bits[2])[fg]
    counts = torch.bincount(codes, minlength=8)
    best = int(counts.argmax())
    return _CODE[((best >> 2) & 1, (best >> 1) & 1, best & 1)]


def colour_reward(image: torch.Tensor, colour: str, min_pixels: int = 3) -> float:
    """1.0 when the image's dominant colour is ``colour``, else 0.0."""
    return 1.0 if dominant_colour(image, min_pixels) == colour else 0.0


def mean_pairwise_distance(images: torch.Tensor) -> float:
    """Mean root-mean-square pixel distance over the pairs of ``images`` ``[N, 3, H, W]``."""
    n = images.shape[0]
    if n < 2:
        return 0.0
    flat = images.reshape(n, -1).double()
    d = torch.cdist(flat, flat) / flat.shape[1] ** 0.5
    return float(d.sum() / (n * (n - 1)))


def diversity(samples: Sequence[Any], key: str = "diffusers") -> float | None:
    """Mean over prompts of the mean pairwise distance among that prompt's images (None when no
    prompt has two images)."""
    by_prompt: dict[str, list[torch.Tensor]] = {}
    for s in samples:
        img = s.extensions.get(key, {}).get("image")
        if img is not None:
            by_prompt.setdefault(str(s.task.prompt), []).append(img)
    vals = [mean_pairwise_distance(torch.stack(v)) for v in by_prompt.values() if len(v) > 1]
    return sum(vals) / len(vals) if vals else None


def save_grid(images: torch.Tensor, path: str, columns: int = 8, scale: int = 4) -> None:
    """A PNG grid of ``images`` ``[N, 3, H, W]`` in [0, 1], each pixel ``scale`` x ``scale``."""
    from PIL import Image

    n, _, h, w = images.shape
    rows = (n + columns - 1) // columns
    grid = torch.full((3, rows * (h + 1) + 1, columns * (w + 1) + 1), 0.5)
    for i in range(n):
        r, c = divmod(i, columns)
        grid[:, 1 + r * (h + 1):1 + r * (h + 1) + h, 1 + c * (w + 1):1 + c * (w + 1) + w] = images[i].clamp(0, 1)
    arr = (grid * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(arr).resize((arr.shape[1] * scale, arr.shape[0] * scale), Image.NEAREST).save(path)
