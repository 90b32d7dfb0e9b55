"""The EAGLE-style draft head: one decoder layer on the target model's own hidden states.

Its entry at position ``j`` fuses the target's final (normed) hidden state ``h_j`` with the
embedding of the token at ``j + 1`` (``fc``); causal self-attention over the entries of positions
``<= j`` of the same sequence and a gated MLP then give a feature in the target's hidden space,
whose logits through the target's own LM head are the draft distribution of the token at
``j + 2``. Attention lets the head copy tokens from the prompt or a tool's output. Drafting ``k``
tokens chains the head on its own output features (EAGLE's feature-level autoregression): the
chained entries are attended by the later steps of the same chain. The attention carries no
position encoding (the target's features carry position, and left padding then changes nothing).
The head reuses the target's embedding and LM head (no weights of its own there), so it is small:
one ``2d -> d`` projection, one attention block of the target's head count and a gated MLP of the
target's intermediate width.

A reduced draft vocabulary (EAGLE-3, ``draft.vocab: N``): the head scores only ``N`` target tokens,
the most frequent next tokens of its training data. Two buffers travel with its weights (state
dict, file, checkpoints, weight syncs): ``draft_vocab [V]``, the subset's target ids in increasing
order and ``-1`` past its size (``V`` wide whatever ``N``, so an engine that never saw the
``draft:`` section holds a buffer of the right shape and reads ``N`` from it), and
``vocab_counts [V]``, the running count of the training targets the subset follows.

``chains`` is the whole-sequence form training uses; the engine's drafter (``HeadDrafter``)
computes the same with a KV cache of its own.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from . import PREFIX
from .config import vocab_too_big

NAME = PREFIX.rstrip(".")  # the submodule's name on the target model


class DraftHead(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, head_dim: int, eps: float = 1e-6,
                 vocab: int = 0, draft_vocab: int | None = None):
        """``vocab``: the target's vocabulary ``V``; ``draft_vocab``: ``N`` (None: all ``V``)."""
        super().__init__()
        size = vocab if draft_vocab is None else draft_vocab
        ids = torch.full((vocab,), -1, dtype=torch.long)
        ids[:size] = torch.arange(size)  # until a token is counted: the first N ids
        self.register_buffer("draft_vocab", ids)
        self.register_buffer("vocab_counts", torch.zeros(vocab, dtype=torch.long))
        self.heads, self.head_dim, self.scale = heads, head_dim, head_dim ** -0.5
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.attn_norm = nn.RMSNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden, eps=eps)
        with torch.no_grad():  # start as "the target's next-token guess": fc passes the feature through
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            self.o.weight.mul_(0.1)
            self.down.weight.mul_(0.1)

    def subset(self) -> torch.Tensor | None:
        """The target ids ``[N]`` the head scores, or None when it scores them all (a host read)."""
        n = int((self.draft_vocab >= 0).sum())
        return None if n == self.draft_vocab.numel() else self.draft_vocab[:n]

    @torch.no_grad()
    def count(self, tokens: torch.Tensor) -> None:
        """Add training targets ``tokens`` (any shape, target ids) to the running counts and take
        the ``N`` most counted as the subset (ties: the lower id), in place: the engine's CUDA
        graphs read the same buffer."""
        V = self.vocab_counts.numel()
        self.vocab_counts += torch.bincount(tokens.reshape(-1).clamp(0, V - 1), minlength=V)
        n = int((self.draft_vocab >= 0).sum())
        if n < V:  # a stable sort of the negated counts: equal counts keep id order
            top = torch.sort(-self.vocab_counts, stable=True).indices[:n]
            self.draft_vocab[:n] = top.sort().values

    def project(self, feature: torch.Tensor, embedding: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """An entry from ``[..., d]`` feature and token embedding: the fused ``x [..., d]`` and its
        query, key and value ``[..., heads, head_dim]``."""
        x = self.fc(torch.cat([feature, embedding], dim=-1))
        q, k, v = self.qkv(self.attn_norm(x)).unflatten(-1, (3, self.heads, self.head_dim)).unbind(-3)
        return x, q, k, v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The normed output feature ``[..., d]`` of an entry ``x`` and its attention output
        ``[..., heads, head_dim]``."""
        x = x + self.o(attended.flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return self.norm(x + self.down(F.silu(gate) * up))

    def chains(self, hidden: torch.Tensor, next_embedding: torch.Tensor, index: torch.Tensor, steps: int,
               feed: Callable[[int, torch.Tensor], torch.Tensor],
               keys: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Output features ``[B, C, d]`` of drafting steps ``1 .. steps`` from each chain start.

        ``hidden [B, S, d]``: the target's states at positions ``0 .. S-1``; ``next_embedding
        [B, S, d]``: the embedding of the token after each; ``index [B, C]``: the chain starts
        (the position whose state and next token step 1 reads); ``feed(s, feature)``: the
        embeddings ``[B, C, d]`` of the tokens step ``s + 1`` reads (the true ones in training, the
        drafts in drafting); ``keys [B, S]``: positions that may be attended (False: padding).
        Step ``s`` of chain ``c`` attends the entries at positions ``<= c`` and the chain's own
        entries of steps ``2 .. s`` (positions ``c + 1 .. c + s - 1``), as drafting does."""
        B, S, _ = hidden.shape
        _, _, k1, v1 = self.project(hidden, next_embedding)  # [B, S, H, D]: every position's entry
        at = torch.arange(S, device=hidden.device)
        mask = at <= index[..., None]  # [B, C, S]
        if keys is not None:  # a padded start still attends itself: no row without a key
            mask = mask & (keys[:, None, :].bool() | (at == index[..., None]))
        own = torch.eye(index.shape[1], dtype=torch.bool, device=hidden.device).expand(B, -1, -1)
        start = index[..., None].expand(-1, -1, hidden.shape[-1])
        feature, emb = hidden.gather(1, start), next_embedding.gather(1, start)
        ks, vs, outs = [k1], [v1], []
        for s in range(1, steps + 1):
            if s > 1:
                feature, emb = outs[-1], feed(s - 1, outs[-1])
            x, q, k, v = self.project(feature, emb)  # [B, C, H, D]
            if s > 1:  # the chain's entry of step s: a key of its own chain's later steps only
                ks.append(k)
                vs.append(v)
                mask = torch.cat([mask, own], dim=-1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat(ks, 1).transpose(1, 2),
                                               torch.cat(vs, 1).transpose(1, 2), attn_mask=mask[:, None],
                                               scale=self.scale)
            outs.append(self.finish(x, o.transpose(1, 2)))
        return outs


def attend(head: DraftHead, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A query ``[B, H, D]`` over cached keys/values ``[B, L, H, D]`` where ``mask [B, L]``: ``[B, H, D]``
    (the engine's form of ``DraftHead.chains``' attention)."""
    scores = torch.einsum("bhd,blhd->bhl", q, k) * head.scale
    w = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")).float(), dim=-1).to(q.dtype)
    return torch.einsum("bhl,blhd->bhd", w, v)


def head_of(model: nn.Module) -> DraftHead | None:
    head = getattr(model, NAME, None)
    return head if isinstance(head, DraftHead) else None


def attach(model: nn.Module, draft_vocab: int | None = None) -> DraftHead:
    """The model's draft head, made (and registered as its ``draft_head`` submodule, on the
    model's device and dtype) if it has none: its weights then travel in the model's state dict,
    so checkpoints and weight syncs carry them under ``draft_head.``. ``draft_vocab``: a new
    head's ``N`` (an engine's head takes its subset from the weights it receives)."""
    head = head_of(model)
    if head is not None:
        return head
    ref = model.get_output_embeddings().weight
    head = make_head(model.config, ref.device, ref.dtype, draft_vocab)
    model.add_module(NAME, head)
    return head


def make_head(config, device: torch.device, dtype: torch.dtype, draft_vocab: int | None = None) -> DraftHead:
    """A fresh head for a model of Hugging Face ``config``: every trainer and the engine size it
    alike, so a head trained by one loads into the other. ``draft_vocab``: ``draft.vocab``."""
    from miles import ConfigError

    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    too_big = vocab_too_big(draft_vocab, config.vocab_size)
    if too_big:
        raise ConfigError([too_big])
    with torch.random.fork_rng(devices=[]):  # the run's own random stream stays as without a draft
        head = DraftHead(config.hidden_size, config.intermediate_size, heads, head_dim,
                         getattr(config, "rms_norm_eps", 1e-6), config.vocab_size, draft_vocab)
    return head.to(device=device, dtype=dtype)  # the id buffers stay int64


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
