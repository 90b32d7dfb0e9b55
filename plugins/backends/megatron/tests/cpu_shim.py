"""TEST-ONLY CPU stand-ins that let megatron-core's forward run without a GPU.

megatron-core moves RoPE's ``inv_freq`` (and a router weight) to ``torch.cuda.current_device()``
on the first forward, and 0.16.1 names Transformer Engine's ``te_general_gemm`` in its MoE router
when TE is absent; its checkpoint writer and pipeline p2p call ``torch.cuda.synchronize``, and a
pipeline's last stage moves its copy of a tied embedding with ``Tensor.cuda()``. ``install()``
points ``torch.cuda.current_device`` at ``"cpu"``, makes ``torch.cuda.synchronize`` a no-op and
``Tensor.cuda`` the identity (this machine has no GPU to move to), gives the router module a
``None`` for that name, and lets the pipeline schedules' token counter (``torch.zeros(...,
device="cuda")``) live on the CPU. Never used by the plugin itself.
"""
from __future__ import annotations

import pytest
import torch


class _TorchOnCPU:
    """``torch`` as megatron-core's pipeline schedules see it: ``zeros(device="cuda")`` on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(schedules, "torch", _TorchOnCPU())

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    if not hasattr(moe_utils, "te_general_gemm"):
        monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
