"""Online training of a model's MTP layers inside a trainer's step (the top-level ``draft:``
section on a model that carries them).

After the policy's update, each MTP layer learns from the step's own sequences what the engine's
``mtp`` draft asks of it: the policy (no gradient) gives its final hidden states, and the layer,
fed hidden state ``i`` and token ``i + 1``, is trained with the cross-entropy of token ``i + 2``
(``mtp_loss``) on response tokens (those it will draft). The layers have their own optimizer, loss
weight and clip; their gradients never mix with the policy's, and the policy's optimizer, which
also holds them, never sees one (they are cleared after every step). Weight syncs and checkpoints
carry them under the checkpoint's own names, as every other weight.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from . import mtp_layers, mtp_loss

OPTIM_FILE = "mtp_optim.pt"


def response_weights(batch: Any) -> torch.Tensor:
    """``[B, L]`` weights of a batch's tokens as targets of the MTP loss: the loss mask on response
    tokens, 0 on the prompt (token ``i + 2`` is predicted where it is a response token)."""
    ids = batch.input_ids
    weights = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    weights[:, batch.prompt_len:] = batch.loss_mask.to(ids.device).float()
    return weights


class MTPTraining:
    """The first MTP layer of ``model`` and its optimizer. ``cfg``: the ``draft:`` section's settings
    (``train``, ``lr``, ``loss_weight``, ``grad_clip``); ``supervised``: the owning trainer runs
    supervised steps (a warm start), where the layers always learn; ``share``: this rank's share
    of a gradient that a sharded trainer sums over ranks which all see the same batch."""

    def __init__(self, cfg: Any, model: torch.nn.Module, supervised: bool = False, share: float = 1.0):
        self.cfg, self.share = cfg, share
        layers = mtp_layers(model)
        if not layers:
            raise ValueError("the model carries no MTP layers")
        # the engine drafts with the first layer (the checkpoints carry one): it alone learns
        self.layer = layers[0]
        self.params = list(self.layer.parameters())
        self.active = cfg.train or supervised
        self.optim = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)

    def step(self, model: torch.nn.Module, batch: Any) -> dict[str, float]:
        """One optimizer step of the MTP layers on ``batch`` (a ``miles.Batch`` of token rows);
        metrics ``mtp_loss`` (the cross-entropy before the step) and ``mtp_top1`` (its
        argmax is the sequence's token)."""
        if not self.active or batch.input_ids is None or batch.attention_mask.dim() != 2:
            return {}
        ids, mask = batch.input_ids, batch.attention_mask
        if ids.shape[1] < 3:
            return {}
        pos = batch.position_ids if batch.position_ids is not None else (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                        output_hidden_states=True, logits_to_keep=1)
            hidden = out.hidden_states[-1].detach()
        weights = response_weights(batch)
        loss, top1 = mtp_loss(self.layer, hidden, ids, mask, pos, model.model.rotary_emb, weights[:, 2:])
        self.optim.zero_grad(set_to_none=True)
        self.backward(loss)
        self.update()
        return {"mtp_loss": float(loss.detach()), "mtp_top1": float(top1)}

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss`` (an ``mtp_loss``, or a part of one) at the layers' weight."""
        (self.cfg.loss_weight * self.share * loss).backward()

    def update(self, reduce: Any = None) -> None:
        """One optimizer step on the accumulated gradients, clipped, then cleared; ``reduce(params)``
        first sums them over the ranks that saw other rows."""
        if reduce is not None:
            reduce(self.params)
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def save(self, path: str) -> None:
        torch.save(self.optim.state_dict(), os.path.join(path, OPTIM_FILE))

    def load(self, path: str) -> None:
        """The optimizer state saved beside a checkpoint (the layers' weights come with the model's)."""
        file = os.path.join(path, OPTIM_FILE)
        if os.path.exists(file):  # weights_only: a planted file cannot run code
            self.optim.load_state_dict(torch.load(file, weights_only=True))
