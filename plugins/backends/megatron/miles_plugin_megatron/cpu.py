"""CPU stand-ins that let megatron-core's forward run without a GPU: for tests and parity checks
on a machine without CUDA (``miles.testing``'s megatron helpers), never used by the trainer itself.

megatron-core moves RoPE's ``inv_freq`` (and a router weight) to ``torch.cuda.current_device()``
on the first forward; its checkpoint writer and pipeline p2p call ``torch.cuda.synchronize``, and a
pipeline's last stage moves its copy of a tied embedding with ``Tensor.cuda()``. ``install()``
points ``torch.cuda.current_device`` at ``"cpu"``, makes ``torch.cuda.synchronize`` a no-op and
``Tensor.cuda`` the identity (there is no GPU to move to), and lets the pipeline schedules' token
counter (``torch.zeros(..., device="cuda")``) live on the CPU.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


class _TorchOnCPU:
    """``torch`` as megatron-core's pipeline schedules see it: ``zeros(device="cuda")`` on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def install(patch: Any) -> None:
    """Install the stand-ins through ``patch.setattr(target, name, value, raising=False)`` (a
    ``pytest.MonkeyPatch`` or ``Patches``), so that they are undone with it."""
    from megatron.core.pipeline_parallel import schedules

    patch.setattr(schedules, "torch", _TorchOnCPU())
    patch.setattr(torch.cuda, "current_device", lambda: "cpu")
    patch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    patch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


class Patches:
    """Attribute replacements, each undone by ``undo()`` (the subset of ``pytest.MonkeyPatch``
    ``install`` uses, without a pytest dependency)."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def setattr(self, target: Any, name: str, value: Any, raising: bool = True) -> None:
        had = hasattr(target, name)
        if raising and not had:
            raise AttributeError(f"{target!r} has no attribute {name!r}")
        self._saved.append((target, name, getattr(target, name, None), had))
        setattr(target, name, value)

    def undo(self) -> None:
        for target, name, old, had in reversed(self._saved):
            if had:
                setattr(target, name, old)
            else:
                delattr(target, name)
        self._saved.clear()


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """megatron-core on CPU while the block runs; afterwards the stand-ins are undone and the
    process groups the trainer started are destroyed (a later trainer starts clean)."""
    from . import parallel

    patches = Patches()
    install(patches)
    try:
        yield
    finally:
        parallel.destroy()
        patches.undo()
