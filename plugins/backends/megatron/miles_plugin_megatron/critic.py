"""A value model (critic) for algorithms that declare ``needs_critic`` (PPO).

``MegatronCriticTrainer`` is the megatron trainer plus a critic: a second megatron-core
``GPTModel`` without output layer (``post_process=False``, same tensor / expert / data-parallel
layout as the policy), the final RMSNorm and a ``Linear(hidden, 1)`` value head replicated on
every rank, and its own AdamW. The loop calls:

* ``values(batch)`` -> ``[B, R]`` no-grad values, ``V_t`` = value of the state right before
  response token ``t`` (the hidden state at the position whose logits predict token ``t``);
* ``train_critic(batch, value_loss_fn)`` -> metrics: one optimizer step of the critic on
  ``value_loss_fn(batch, values_with_grad) -> (loss, metrics)``.

The critic's backbone is copied from the policy the first time it is used (after a supervised
warm start it starts from the warm-started model); the head starts at zero, so the first values
are 0 and the first advantages are the plain returns. ``checkpoint.py`` saves and resumes it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from miles import Batch, MilesError
from miles.protocols import CriticAlgorithm

from . import pipeline
from .rows import right_aligned
from .trainer import MegatronTrainer


class ValueModel(torch.nn.Module):
    """``gpt`` (decoder without final norm and output layer) + final RMSNorm + value head."""

    def __init__(self, gpt: torch.nn.Module, hidden: int, eps: float):
        super().__init__()
        self.gpt = gpt
        self.norm = torch.nn.RMSNorm(hidden, eps=eps)
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def megatron_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Parameters under the policy's Megatron names (the backbone's carry no ``gpt.``
        prefix), which is what the trainer's gradient reduction and norm read sharding from."""
        return [(n.removeprefix("gpt."), p) for n, p in self.named_parameters()]


class MegatronCriticTrainer(MegatronTrainer):
    """The megatron trainer with a critic (any tensor / expert / data-parallel layout)."""

    def __init__(self, cfg: Any, *, algorithm: Any = None, **context: Any):
        super().__init__(cfg, algorithm=algorithm, **context)
        if self.arch.hc_mult > 1:  # its backbone would end in the streams, not one hidden state
            raise MilesError(f"trainer megatron: a critic over {self.arch.family}'s {self.arch.hc_mult} "
                             f"hyper-connection streams (model.config.hc_mult) is not built; use an algorithm "
                             f"without a critic (grpo) or trainer.name: fsdp2")
        self.critic_lr = (algorithm.critic_lr if isinstance(algorithm, CriticAlgorithm) else None) or cfg.lr
        self.critic: ValueModel | None = None
        self.critic_optim: torch.optim.Optimizer | None = None

    def build_critic(self) -> ValueModel:
        """The critic (built from the policy's current weights on first use)."""
        if self.critic is not None:
            return self.critic
        gpt = self._build(head=False, tied=False)  # the policy's layout (stages, chunks)
        critic = ValueModel(gpt, self.arch.hidden, self.arch.eps).to(self.device)
        own = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        mine = {"gpt." + k: v for k, v in own.items()
                if not pipeline.unchunked(k).startswith(("output_layer.", "decoder.final_layernorm."))}
        if self.last_stage:  # with pipeline stages, only the last one runs the norm and the head
            mine["norm.weight"] = own[pipeline.last_prefix(self.vp) + "decoder.final_layernorm.weight"]
        missing, unexpected = critic.load_state_dict(mine, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state") and not k.startswith("head.")
                   and (self.last_stage or k != "norm.weight")]
        if missing or unexpected:
            raise MilesError(f"trainer megatron: the critic does not match the policy's weights "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        self.critic = critic.train()
        self.critic_optim = torch.optim.AdamW(critic.parameters(), lr=self.critic_lr, betas=self.cfg.betas,
                                              eps=self.cfg.eps, weight_decay=self.cfg.weight_decay, fused=True)
        return critic

    def _head(self, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``[B, R]`` values from the last stage's hidden states."""
        _, index = right_aligned(batch)
        h = h.transpose(0, 1).gather(1, index.unsqueeze(-1).expand(-1, -1, h.shape[-1])).float()
        return self.critic.head(self.critic.norm(h)).squeeze(-1)

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        critic = self.build_critic().eval()
        out = self._rows(critic.gpt, batch, self._forward, self._head)
        critic.train()
        return out

    def train_critic(self, batch: Batch, value_loss_fn: Callable) -> dict[str, float]:
        critic = self.build_critic()
        totals = self._loss(critic.gpt, batch, self._forward, self._head, value_loss_fn)[0]
        if self.dp > 1:  # each rank's loss is its share of the global mean: the sum is the whole
            totals = self._sum_dp(totals)
        named = critic.megatron_named_parameters()
        self._reduce_grads(named)
        norm = self._clip(named)
        if math.isfinite(norm):
            self.critic_optim.step()
        else:
            totals["critic_nonfinite_skipped"] = 1.0
        self.critic_optim.zero_grad(set_to_none=True)
        totals["critic_grad_norm"] = norm
        return totals
