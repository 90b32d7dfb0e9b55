"""Forward-process scoring: the transformer's velocity at noised copies ``x_t`` of clean samples,
for algorithms trained on the forward (noising) process, such as DiffusionNFT, rather than on
the sampler's transitions.

A batch asks for it with ``extras["x_t"]`` ``[B, K, C, h, w]`` (K noised copies of each sample)
and ``extras["sigma_t"]`` ``[B, K]`` beside its conditioning (``embeds`` ``[B, L, D]``, ``pooled``
``[B, D]``). The answer is ``[B, 2 * K * C * h * w]``: the model's velocities (differentiable),
then the old policy's (no gradient). The old policy is an exponential moving average of the
model's weights, ``old <- decay * old + (1 - decay) * model``, folded in once per weight version
of the batch's samples (before that version's first update, so decay 0 is the policy that
sampled them); ``extras["old_decay"]`` sets the decay.
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from miles import MilesError

from . import sde


class OldPolicy:
    """The EMA copy of the trained transformer, kept beside it (same device and dtype). Its
    weights and version are training state (``state``/``load_state``): a trainer checkpoints them
    with the model, so a resumed run folds the EMA on as an uninterrupted one does."""

    def __init__(self) -> None:
        self.module: torch.nn.Module | None = None
        self.owner: int | None = None  # id() of the model it shadows
        self.version: int | None = None

    @torch.no_grad()
    def update(self, model: torch.nn.Module, version: int, decay: float) -> torch.nn.Module:
        if self.module is None or self.owner != id(model):
            # the first batch of a run: the old policy starts as the model
            self._start(model)
            self.version = version
        elif version != self.version:
            for old, new in zip(self.module.parameters(), model.parameters()):
                old.mul_(decay).add_(new.detach(), alpha=1 - decay)
            self.version = version
        return self.module

    def _start(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):  # FSDP2 modules cannot be deep-copied
            raise MilesError("the forward-process old policy (algorithm diffusion-nft) needs an unsharded "
                             "trainer: set trainer.world_size: 1 and leave trainer.shard unset")
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.owner, self.version = id(model), None

    def state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The EMA's tensors (``old_policy.<name>``) and version (``old_policy_version``); empty
        while there is no EMA of ``model`` (a run that never scored a forward-process batch keeps
        nothing)."""
        if self.module is None or self.owner != id(model):
            return {}
        state = {f"old_policy.{k}": v for k, v in self.module.state_dict().items()}
        state["old_policy_version"] = torch.tensor(self.version, dtype=torch.int64)
        return state

    @torch.no_grad()
    def load_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Take back what ``state`` returned (e.g. on the CPU): the EMA becomes a copy of ``model``
        (its device and dtype) holding those values."""
        self._start(model)
        live = {f"old_policy.{k}": v for k, v in self.module.state_dict().items()}
        live["old_policy_version"] = torch.zeros((), dtype=torch.int64)
        misfit = sorted(set(live) ^ set(state)) or [k for k in live if live[k].shape != state[k].shape]
        if misfit:
            raise MilesError(f"the old policy's checkpointed state does not fit this model ({misfit[:3]} "
                             f"differ); restore the model settings it was written with")
        for k, dst in live.items():
            dst.copy_(state[k].to(dst.device, dst.dtype))
        self.version = int(state["old_policy_version"])


def velocities(model: torch.nn.Module, extras: dict[str, Any], samples: Sequence[Any],
               old: OldPolicy) -> torch.Tensor:
    """See the module docstring: ``[B, 2 * K * D]`` (the model's, then the old policy's)."""
    x_t, sig = extras["x_t"], extras["sigma_t"]
    B, K = x_t.shape[:2]
    cond = {k: extras[k].repeat_interleave(K, dim=0) for k in ("embeds", "pooled")}
    flat, sigma = x_t.reshape(B * K, *x_t.shape[2:]), sig.reshape(B * K)
    version = max((int(s.weight_version) for s in samples), default=0)
    shadow = old.update(model, version, float(extras.get("old_decay", 0.0)))
    v = sde.velocity(model, flat, sigma, cond, 1.0)  # CFG-free: the conditional velocity
    with torch.no_grad():
        v_old = sde.velocity(shadow, flat, sigma, cond, 1.0)
    return torch.cat([v.reshape(B, -1), v_old.reshape(B, -1)], dim=1)
