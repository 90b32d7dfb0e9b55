"""The EAGLE-style draft head: one layer on the target model's own hidden states.

Input at position ``j``: the target's final (normed) hidden state ``h_j`` and the embedding of
the token at ``j + 1``; output: a feature in the same space, whose logits through the target's
own LM head are the draft distribution of the token at ``j + 2``. Drafting ``k`` tokens chains
the head on its own output features (EAGLE's feature-level autoregression), so one target
forward per step is all the context the head needs: it has no attention and no cache of its own.
The head reuses the target's embedding and LM head (no weights of its own there), so it is small:
one ``2d -> d`` projection and a gated MLP of the target's intermediate width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from . import PREFIX

NAME = PREFIX.rstrip(".")  # the submodule's name on the target model


class DraftHead(nn.Module):
    def __init__(self, hidden: int, intermediate: int, eps: float = 1e-6):
        super().__init__()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden, eps=eps)
        with torch.no_grad():  # start as "the target's next-token guess": fc passes the feature through
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            self.down.weight.mul_(0.1)

    def forward(self, feature: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` feature and token embedding -> ``[..., d]`` normed output feature."""
        x = self.fc(torch.cat([feature, embedding], dim=-1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return self.norm(x + self.down(F.silu(gate) * up))


def head_of(model: nn.Module) -> DraftHead | None:
    head = getattr(model, NAME, None)
    return head if isinstance(head, DraftHead) else None


def attach(model: nn.Module) -> DraftHead:
    """The model's draft head, made (and registered as its ``draft_head`` submodule, on the
    model's device and dtype) if it has none: its weights then travel in the model's state dict,
    so checkpoints and weight syncs carry them under ``draft_head.``."""
    head = head_of(model)
    if head is not None:
        return head
    ref = model.get_output_embeddings().weight
    head = make_head(model.config, ref.device, ref.dtype)
    model.add_module(NAME, head)
    return head


def make_head(config, device: torch.device, dtype: torch.dtype) -> DraftHead:
    """A fresh head for a model of Hugging Face ``config``: every trainer and the engine size it
    alike, so a head trained by one loads into the other."""
    with torch.random.fork_rng(devices=[]):  # the run's own random stream stays as without a draft
        head = DraftHead(config.hidden_size, config.intermediate_size, getattr(config, "rms_norm_eps", 1e-6))
    return head.to(device=device, dtype=dtype)


def head_logits(model: nn.Module, feature: torch.Tensor) -> torch.Tensor:
    """Logits of a head output feature through the target's LM head (detached: the head's loss
    must leave no gradient on the policy's weights)."""
    return F.linear(feature, lm_weight(model))


def embed(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, embedding_weight(model))


def lm_weight(model: nn.Module) -> torch.Tensor:
    """The target's whole LM head weight ``[V, d]``, detached."""
    return _full(model.get_output_embeddings().weight).detach()


def embedding_weight(model: nn.Module) -> torch.Tensor:
    """The target's whole input embedding ``[V, d]``, detached."""
    return _full(model.get_input_embeddings().weight).detach()


def _full(w: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) weight gathered whole; a plain one as it is."""
    return w.full_tensor() if isinstance(w, DTensor) else w
