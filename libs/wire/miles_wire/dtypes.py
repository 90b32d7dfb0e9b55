"""Names and sizes of tensors on the wire, and their checksums.

``dtype_name``/``to_dtype``: dtype strings without ``torch.`` (as SGLang sends them); ``nbytes``;
``checksum``: blake2b-128 of a tensor's raw bytes, exact for every dtype.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from miles import MilesError

if TYPE_CHECKING:  # pragma: no cover
    import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise MilesError(f"weight sync: unknown dtype {name!r} (expected a torch dtype name such as "
                         "'float32' or 'bfloat16')")
    return dtype


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def checksum(t: torch.Tensor) -> str:
    """blake2b-128 of a tensor's raw bytes (any dtype, any device; bit-exact comparison)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return hashlib.blake2b(flat.contiguous().view(_uint8()).numpy(), digest_size=16).hexdigest()


def _uint8():
    import torch

    return torch.uint8
