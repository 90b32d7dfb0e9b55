"""A value model (critic) for algorithms that declare ``needs_critic`` (PPO), on one rank.

``CriticTrainer`` is the fsdp2 trainer plus a critic: the spec's model backbone with a linear
value head, its own AdamW, and two extra methods the loop calls when
``algorithm.needs_critic``:

* ``values(batch)`` -> ``[B, R]`` no-grad values, ``V_t`` = value of the state right before
  response token ``t`` (the hidden state at the position whose logits predict token ``t``);
* ``train_critic(batch, value_loss_fn)`` -> metrics: one optimizer step of the critic on
  ``value_loss_fn(batch, values_with_grad) -> (loss, metrics)``.

The critic's backbone is copied from the policy the first time it is used (so after a
supervised warm start it starts from the warm-started model; the head starts at zero, so the
first values are 0); its weights and optimizer are saved beside the trainer's as
``critic.pt`` and restored on resume.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from miles import Batch
from miles.protocols import CriticAlgorithm

from .trainer import FSDP2Trainer

CRITIC_FILE = "critic.pt"


class ValueModel(torch.nn.Module):
    """Transformer backbone (no LM head) + ``Linear(hidden, 1)`` over the response states."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1)
        # Zero head: initial values are 0, so the first advantages are the plain returns
        # instead of noise from a random projection.
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: Batch) -> torch.Tensor:
        P, L = batch.prompt_len, batch.input_ids.shape[1]
        out = self.backbone(input_ids=batch.input_ids[:, :L - 1], attention_mask=batch.attention_mask[:, :L - 1],
                            position_ids=batch.position_ids[:, :L - 1], use_cache=False)
        h = out.last_hidden_state[:, P - 1:]  # position P-1+t predicts response token t
        return self.head(h.float()).squeeze(-1)


def build_value_model(spec: Any, tokenizer: Any, policy_weights: dict[str, torch.Tensor]) -> ValueModel:
    """The spec's model with the policy's weights, cut to its backbone, plus a value head."""
    with torch.random.fork_rng():  # building must not shift the run's random stream
        full = spec.build_model(tokenizer)
    full.load_state_dict(policy_weights, strict=True)
    backbone = getattr(full, "base_model", None)
    if backbone is None or backbone is full:
        from miles import MilesError
        raise MilesError(f"the critic needs a Hugging Face-style model with a separate backbone "
                         f"(`.base_model`); model spec built {type(full).__name__}")
    return ValueModel(backbone, full.config.hidden_size)


class CriticTrainer(FSDP2Trainer):
    """The fsdp2 trainer with a critic (world size 1)."""

    def __init__(self, cfg, *, spec: Any, tokenizer: Any, algorithm: Any = None, **context):
        super().__init__(cfg, spec=spec, tokenizer=tokenizer, algorithm=algorithm, **context)
        if getattr(self, "world_size", 1) > 1:
            from miles import MilesError
            raise MilesError("the critic (algorithm with needs_critic, e.g. ppo) runs on one trainer "
                             "rank only; set trainer.world_size=1")
        self._spec, self._tokenizer = spec, tokenizer
        self.critic_lr = (algorithm.critic_lr if isinstance(algorithm, CriticAlgorithm) else None) or cfg.lr
        self.critic: ValueModel | None = None
        self.critic_optim: torch.optim.Optimizer | None = None

    def _ensure_critic(self) -> ValueModel:
        if self.critic is None:
            weights = {k: v.clone() for k, v in self.named_weights()}
            self.critic = build_value_model(self._spec, self._tokenizer, weights).to(self.device).train()
            self.critic_optim = torch.optim.AdamW(self.critic.parameters(), lr=self.critic_lr,
                                                  betas=self.cfg.betas, eps=self.cfg.eps,
                                                  weight_decay=self.cfg.weight_decay, fused=True)
        return self.critic

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        critic = self._ensure_critic()
        size = self.cfg.micro_batch_size or len(batch)
        return torch.cat([critic(self._to(mb)).cpu() for mb in batch.split(size)])

    def train_critic(self, batch: Batch, value_loss_fn: Callable) -> dict[str, float]:
        critic = self._ensure_critic()
        size = self.cfg.micro_batch_size or len(batch)
        totals: dict[str, float] = {}
        for mb in (batch.split(size) if size < len(batch) else [batch]):
            mb = self._to(mb)
            mb.extras = {k: v.to(self.device) if hasattr(v, "to") else v for k, v in mb.extras.items()}
            loss, metrics = value_loss_fn(mb, critic(mb))
            loss.backward()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) * len(mb) / len(batch)
        params = list(critic.parameters())
        if self.cfg.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None))
        self.critic_optim.step()
        self.critic_optim.zero_grad(set_to_none=True)
        totals["critic_grad_norm"] = float(norm)
        return totals

    def save(self, path: str) -> None:
        super().save(path)
        if self.critic is not None:
            torch.save({"critic": self.critic.state_dict(), "optim": self.critic_optim.state_dict()},
                       os.path.join(path, CRITIC_FILE))

    def load(self, path: str) -> None:
        super().load(path)
        file = os.path.join(path, CRITIC_FILE)
        if os.path.exists(file):  # else (a checkpoint from a critic-less run) built on first use
            state = torch.load(file, map_location=self.device, weights_only=True)
            self._ensure_critic().load_state_dict(state["critic"])
            self.critic_optim.load_state_dict(state["optim"])
