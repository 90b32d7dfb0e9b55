"""Packing: tensors of any dtypes placed in one uint8 buffer at ``ALIGN``-byte offsets (both ends
compute the offsets from dtypes and shapes alone), and the plan of which tensors of a broadcast
bucket travel packed and which on their own. ``SHM_FORMAT``/``CUDA_IPC_FORMAT`` name the payload
formats of ``engine.update_weights_from_tensor`` (described in the torch engine's ``weights.py``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .dtypes import to_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

# payload formats of engine.update_weights_from_tensor (described in the torch engine's weights.py)
SHM_FORMAT = "miles-shm/1"
CUDA_IPC_FORMAT = "miles-cuda-ipc/1"
# 64 bytes: any dtype view of a packed slot is aligned (and cache-line aligned for the copy)
ALIGN = 64


def align(n: int) -> int:
    """``n`` rounded up to ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(dtypes: Sequence[Any], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a packed buffer, and the buffer's size."""
    offsets, end = [], 0
    for dtype, shape in zip(dtypes, shapes):
        dtype = to_dtype(dtype) if isinstance(dtype, str) else dtype
        offsets.append(end)
        end = align(end + _numel(shape) * dtype.itemsize)
    return offsets, end


def views(buf: torch.Tensor, dtypes: Sequence[Any], shapes: Sequence[Sequence[int]],
          offsets: Sequence[int]) -> list[torch.Tensor]:
    """Typed views of a uint8 ``buf`` at ``offsets`` (no copy)."""
    out = []
    for dtype, shape, off in zip(dtypes, shapes, offsets):
        dtype = to_dtype(dtype) if isinstance(dtype, str) else dtype
        out.append(buf[off:off + _numel(shape) * dtype.itemsize].view(dtype).view(tuple(int(d) for d in shape)))
    return out


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int], buf: torch.Tensor,
         dtypes: Sequence[Any] | None = None) -> None:
    """Copy ``tensors`` into the uint8 ``buf`` at ``offsets``, as ``dtypes`` (default: their own;
    any device pair copy_ handles)."""
    import torch

    slots = views(buf, dtypes or [t.dtype for t in tensors], [t.shape for t in tensors], offsets)
    torch._foreach_copy_(slots, list(tensors))  # few kernel launches for the whole bucket on CUDA


@dataclass
class WirePlan:
    """How one broadcast bucket travels: ``packed`` tensors (indices) share one uint8 buffer of
    ``packed_bytes`` at ``offsets``, sent first; each ``direct`` tensor is then sent on its own,
    straight from the trainer's tensor into the engine's parameter (no packing copies)."""

    packed: list[int]
    offsets: list[int]
    packed_bytes: int
    direct: list[int]


def wire_plan(dtypes: Sequence[Any], shapes: Sequence[Sequence[int]], pack_below: int) -> WirePlan:
    """Tensors under ``pack_below`` bytes are packed; the rest go direct. ``pack_below=0`` sends
    every tensor on its own, which is SGLang's own wire format for this call."""
    sizes = [(to_dtype(d) if isinstance(d, str) else d).itemsize * _numel(s)
             for d, s in zip(dtypes, shapes)]
    packed = [i for i, n in enumerate(sizes) if n < pack_below]
    direct = [i for i, n in enumerate(sizes) if n >= pack_below]
    offsets, total = layout([dtypes[i] for i in packed], [shapes[i] for i in packed])
    return WirePlan(packed, offsets, total, direct)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
