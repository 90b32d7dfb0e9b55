"""Element-wise pieces of a Llama-family forward that the engine's and the trainer's fast paths
must compute identically (in the module's own op order)."""
from __future__ import annotations

from typing import Any

import torch


def rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """Hugging Face's Llama/Qwen2 ``RMSNorm`` forward for the module ``norm`` (its ``weight`` and
    ``variance_epsilon``), in its op order: float32 statistics, the result cast back to ``x``'s
    dtype before the weight multiplies it, so half-precision rounding matches the module's (the
    casts are no-ops in float32). ``F.rms_norm`` is no faster on CPU, where it is a composite of
    the same steps."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)
