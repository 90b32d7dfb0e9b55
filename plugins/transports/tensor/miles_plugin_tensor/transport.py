"""In-process weight sync: tensors are handed to the engine by reference and copied in place."""
from __future__ import annotations

import time
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field


class TensorSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verify: bool = Field(False, description="after each sync, check every engine tensor equals the "
                                            "trainer's bit for bit; fail the run on a mismatch")


class TensorTransport:
    def __init__(self, cfg: TensorSyncConfig):
        self.cfg = cfg

    def sync(self, trainer: Any, engines: Sequence[Any], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        nbytes = 0
        for engine in engines:
            named = list(trainer.named_weights())
            nbytes += sum(t.numel() * t.element_size() for _, t in named)
            engine.load_weights(named, version)
            if self.cfg.verify:
                _verify(named, engine)
        return {"weight_sync_seconds": time.perf_counter() - t0, "weight_sync_bytes": float(nbytes)}


def _verify(named, engine) -> None:
    import torch

    from miles import MilesError

    have = dict(engine.named_weights()) if hasattr(engine, "named_weights") else None
    if have is None:
        raise MilesError("sync.verify needs an engine that exposes named_weights()")
    for name, t in named:
        if not torch.equal(have[name].to(t.device, t.dtype), t):
            raise MilesError(f"weight sync verification failed: engine tensor {name} differs from the trainer's")
