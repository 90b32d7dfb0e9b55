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

import contextlib
import copy
from typing import Any, Iterator, Sequence

import torch
from miles import MilesError

from . import sde


class OldPolicy:
    """The EMA of the trained transformer's weights, kept beside it (same device and dtype). Its
    weights and version are training state (``state``/``load_state``): a trainer checkpoints them
    with the model, so a resumed run folds the EMA on as an uninterrupted one does.

    Unsharded, it is a copy of the module. Of an FSDP2-sharded model (which cannot be copied) it is
    each parameter's EMA shard, a DTensor laid out as the parameter: ``active`` swaps those into
    the model's own shards for the old policy's forward and swaps the trained ones back."""

    def __init__(self) -> None:
        self.module: torch.nn.Module | None = None
        self.shards: dict[str, torch.Tensor] | None = None  # parameter name -> its EMA (sharded)
        self.owner: int | None = None  # id() of the model it shadows
        self.version: int | None = None

    @torch.no_grad()
    def update(self, model: torch.nn.Module, version: int, decay: float) -> None:
        if self.owner != id(model):
            # the first batch of a run: the old policy starts as the model
            self._start(model)
            self.version = version
        elif version != self.version:
            ema = self.module.parameters() if self.module is not None else self.shards.values()
            for old, new in zip(ema, model.parameters()):
                old.mul_(decay).add_(new.detach(), alpha=1 - decay)
            self.version = version

    @contextlib.contextmanager
    def active(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The old policy as a module to run without gradients."""
        if self.module is not None:
            yield self.module
            return
        params = list(model.parameters())
        with torch.no_grad():
            trained = [p.detach().clone() for p in params]
            for p, old in zip(params, self.shards.values()):
                p.copy_(old)
            try:
                yield model
            finally:
                # FSDP2 keeps the root's gathered weights after a forward without backward: free
                # them, or the training forward would run the root on the old policy's values
                model.reshard()
                for p, t in zip(params, trained):
                    p.copy_(t)

    def _start(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):  # FSDP2 modules cannot be deep-copied: the shards can
            self.module, self.shards = None, {n: p.detach().clone() for n, p in model.named_parameters()}
        else:
            self.module, self.shards = copy.deepcopy(model).eval().requires_grad_(False), None
        self.owner, self.version = id(model), None

    def state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The EMA's tensors (``old_policy.<name>``, the names of ``model``'s state dict; sharded
        as the model) and version (``old_policy_version``); empty while there is no EMA of
        ``model`` (a run that never scored a forward-process batch keeps nothing)."""
        if self.owner != id(model):
            return {}
        return {**self._tensors(model), "old_policy_version": torch.tensor(self.version, dtype=torch.int64)}

    def _tensors(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        own = self.module.state_dict() if self.module is not None else model.state_dict()
        return {f"old_policy.{k}": self.shards.get(k, v) if self.shards is not None else v for k, v in own.items()}

    @torch.no_grad()
    def load_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Take back what ``state`` returned, as full tensors (e.g. on the CPU): the EMA becomes a
        copy of ``model`` (its device, dtype and sharding) holding those values."""
        self._start(model)
        live = self._tensors(model)
        shapes = {k: tuple(v.shape) for k, v in live.items()}  # a DTensor's shape is the full one
        live["old_policy_version"] = torch.zeros((), dtype=torch.int64)
        misfit = sorted(set(live) ^ set(state)) or [k for k in shapes if shapes[k] != tuple(state[k].shape)]
        if misfit:
            raise MilesError(f"the old policy's checkpointed state does not fit this model ({misfit[:3]} "
                             f"differ); restore the model settings it was written with")
        for k, dst in live.items():
            sharded_buffer = self.shards is not None and k.removeprefix("old_policy.") not in self.shards
            if k == "old_policy_version" or sharded_buffer:  # a sharded model's buffers are its own
                continue
            full = state[k].to(dst.device, dst.dtype)
            if hasattr(dst, "device_mesh"):  # each rank keeps its chunk of the full tensor
                from torch.distributed.tensor import distribute_tensor

                full = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None)
            dst.copy_(full)
        self.version = int(state["old_policy_version"])


def velocities(model: torch.nn.Module, extras: dict[str, Any], samples: Sequence[Any],
               old: OldPolicy) -> torch.Tensor:
    """See the module docstring: ``[B, 2 * K * D]`` (the model's, then the old policy's)."""
    x_t, sig = extras["x_t"], extras["sigma_t"]
    B, K = x_t.shape[:2]
    cond = {k: extras[k].repeat_interleave(K, dim=0) for k in ("embeds", "pooled")}
    flat, sigma = x_t.reshape(B * K, *x_t.shape[2:]), sig.reshape(B * K)
    version = max((int(s.weight_version) for s in samples), default=0)
    old.update(model, version, float(extras.get("old_decay", 0.0)))
    with torch.no_grad(), old.active(model) as shadow:  # first: a sharded model swaps weights
        v_old = sde.velocity(shadow, flat, sigma, cond, 1.0)
    v = sde.velocity(model, flat, sigma, cond, 1.0)  # CFG-free: the conditional velocity
    return torch.cat([v.reshape(B, -1), v_old.reshape(B, -1)], dim=1)
