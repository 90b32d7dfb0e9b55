"""Online training of the draft head inside a trainer's step.

After the policy's update, the head learns from the step's own sequences: the policy (no
gradient) gives its final hidden states and next-token distributions, and the head, fed the
hidden state at ``j`` and the token at ``j + 1``, is trained toward the policy's distribution of
the token at ``j + 2`` (a KL, i.e. cross-entropy on soft targets), on response positions only
(the tokens it will draft). ``unroll`` steps chain the head on its own features, as drafting
does. The head has its own optimizer and clip: nothing reaches the policy's gradients.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .config import DraftConfig
from .head import attach, embed, head_logits

OPTIM_FILE = "draft_optim.pt"


class DraftTraining:
    """The head of ``model`` (attached if missing) and its optimizer. ``supervised``: the owning
    trainer runs supervised steps (a warm start), where the head always learns."""

    def __init__(self, cfg: DraftConfig, model: torch.nn.Module, supervised: bool = False):
        self.cfg = cfg
        self.head = attach(model)
        self.active = cfg.train or supervised
        self.optim = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, weight_decay=0.0)

    def step(self, model: torch.nn.Module, batch: Any) -> dict[str, float]:
        """One optimizer step of the head on ``batch`` (a ``miles.Batch`` of token rows); metrics
        ``draft_loss`` (KL to the policy, step 1), ``draft_top1`` (the head's argmax is the policy's)."""
        if not self.active or batch.input_ids is None or batch.attention_mask.dim() != 2:
            return {}
        P, R = batch.prompt_len, batch.input_ids.shape[1] - batch.prompt_len
        if R < 2:
            return {}
        with torch.no_grad():
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids, use_cache=False, output_hidden_states=True,
                        logits_to_keep=R)
            hidden = out.hidden_states[-1][:, P - 1:-1].detach()  # h_j, j = P-1 .. L-2
            target = torch.log_softmax(out.logits.float(), dim=-1)  # policy at columns P .. L-1
        mask = batch.loss_mask.to(hidden.device).float()
        feats, losses, metrics = hidden, [], {}
        for s in range(1, min(self.cfg.unroll, R - 1) + 1):
            tokens = batch.input_ids[:, P + s - 1:P + R - 1]
            feats = self.head(feats[:, :R - s], embed(model, tokens).detach())
            logq = torch.log_softmax(head_logits(model, feats).float(), dim=-1)
            logp, m = target[:, s - 1:R - 1], mask[:, s:R]
            kl = (logp.exp() * (logp - logq)).sum(-1)
            denom = m.sum().clamp(min=1)
            losses.append((kl * m).sum() / denom)
            if s == 1:
                top1 = (logq.argmax(-1) == logp.argmax(-1)).float()
                metrics = {"draft_loss": float(losses[0].detach()), "draft_top1": float((top1 * m).sum() / denom)}
        loss = self.cfg.loss_weight * torch.stack(losses).mean()
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.grad_clip)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return metrics

    def save(self, path: str) -> None:
        torch.save(self.optim.state_dict(), os.path.join(path, OPTIM_FILE))

    def load(self, path: str) -> None:
        """The optimizer state saved beside a checkpoint (the head's weights come with the model's)."""
        file = os.path.join(path, OPTIM_FILE)
        if os.path.exists(file):  # weights_only: a planted file cannot run code
            self.optim.load_state_dict(torch.load(file, weights_only=True))
