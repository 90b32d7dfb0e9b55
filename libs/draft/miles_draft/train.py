"""Online training of the draft head inside a trainer's step.

After the policy's update, the head learns from the step's own sequences: the policy (no
gradient) gives its final hidden states and next-token distributions, and the head, fed the
hidden state at ``j`` and the token at ``j + 1``, is trained toward the policy's distribution of
the token at ``j + 2`` (a KL, i.e. cross-entropy on soft targets), on response positions only
(the tokens it will draft), its attention over the whole sequence (prompt included) under a
causal mask. ``unroll`` steps chain the head on its own features, as drafting does
(``DraftHead.chains``). The head has its own optimizer and clip: nothing reaches the policy's gradients.

``HeadTraining`` is the part every trainer shares (the loss over given hidden states, the
optimizer step, its state on disk); ``DraftTraining`` runs it on a Hugging Face model whose
``draft_head`` submodule it is. A trainer with another model (megatron-core's) feeds
``HeadTraining`` the hidden states, target log-probs and vocabulary weights it gathered itself.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .config import DraftConfig
from .head import DraftHead, attach, embedding_weight, lm_weight

OPTIM_FILE = "draft_optim.pt"
# the latest supervised phase's head training in this process: the RL phase after a warm start
# (a trainer of its own, handed only the weights) takes over its AdamW state (``_adopt``)
_supervised: weakref.ref | None = None


def denominators(mask: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """The response tokens each unrolled step scores (at least one) over the rows of ``mask``
    ``[B, R]``: a trainer that splits a batch over micro-batches or ranks computes them over the
    whole batch, so the parts' losses and metrics add up to the whole batch's."""
    R = mask.shape[1]
    return [mask[:, s:R].float().sum().clamp(min=1) for s in range(1, min(unroll, R - 1) + 1)]


class HeadTraining:
    """A draft head and its own AdamW. ``supervised``: the owning trainer runs supervised steps
    (a warm start), where the head always learns, even with ``train: false``."""

    def __init__(self, cfg: DraftConfig, head: DraftHead, supervised: bool = False):
        global _supervised
        self.cfg, self.head = cfg, head
        self.active = cfg.train or supervised
        # passes over each RL step's rows; the warm start keeps one so a frozen head is the same
        # whatever the online arm's setting
        self.passes = 1 if supervised else cfg.updates_per_step
        self.optim = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, weight_decay=0.0)
        self._warm: tuple[dict, dict] | None = None
        warm = _supervised() if _supervised is not None else None
        if supervised:
            _supervised = weakref.ref(self)
        elif warm is not None and cfg.train:  # the warm start's head and optimizer, as they ended
            self._warm = ({k: v.detach() for k, v in warm.head.named_parameters()}, warm.optim.state_dict())

    def loss(self, hidden: torch.Tensor, nxt: torch.Tensor, index: torch.Tensor, target: torch.Tensor,
             mask: torch.Tensor, embedding: torch.Tensor, lm_head: torch.Tensor, denoms: list[torch.Tensor],
             keys: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The head's loss on rows of response positions. ``hidden [B, S, d]``: the policy's final
        hidden states at positions ``0 .. S-1`` (the context the head attends), ``nxt [B, S]`` the
        token after each, ``keys [B, S]`` positions that may be attended (None: all; padding
        excluded), ``index [B, R]`` the position before each response token; ``target [B, R - 1, V]``
        the policy's log-probs of response tokens ``1 .. R - 1`` (the head, fed the state before token
        ``i`` and token ``i``, predicts token ``i + 1``), ``mask [B, R]`` which response tokens are
        trained, ``embedding``/``lm_head [V, d]`` the policy's (detached). ``denoms``:
        ``denominators`` of the whole batch. Metrics (this part's share of the batch's):
        ``draft_loss`` (KL to the policy, step 1), ``draft_top1`` (the head's argmax is the policy's)
        and, with a reduced draft vocabulary, ``draft_vocab_cover`` (the share of trained targets in
        the subset; the others are no part of the loss, and the KL is to the policy's distribution
        renormalised over the subset)."""
        R, S = mask.shape[1], hidden.shape[1]
        dtype = self.head.fc.weight.dtype
        hidden, embedding = hidden.to(dtype), embedding.to(dtype)
        starts = index[:, :R - 1]  # chains whose first draft is a scored response token
        sub = self.head.subset()  # a reduced draft vocabulary: the head scores only these ids
        if sub is not None:
            sub = sub.to(lm_head.device)
            inside = torch.zeros(lm_head.shape[0], dtype=torch.bool, device=lm_head.device)
            inside[sub] = True
            lm_head = lm_head[sub]

        def feed(s: int, _feature: torch.Tensor) -> torch.Tensor:  # step s + 1 reads the true token
            return F.embedding(nxt.gather(1, (starts + s).clamp(max=S - 1)), embedding)

        outs = self.head.chains(hidden, F.embedding(nxt, embedding), starts, len(denoms), feed, keys)
        losses, metrics = [], {}
        for s, feats in enumerate(outs, start=1):
            logq = torch.log_softmax(F.linear(feats[:, :R - s], lm_head.to(dtype)).float(), dim=-1)
            logp, m = target[:, s - 1:R - 1].float(), mask[:, s:R].float()
            best, drafted = logp.argmax(-1), logq.argmax(-1)
            covered = m
            if sub is not None:  # targets outside the subset leave the loss; the policy renormalised within it
                covered = m * inside[nxt.gather(1, (starts[:, :R - s] + s).clamp(max=S - 1))].float()
                logp, drafted = torch.log_softmax(logp[..., sub], dim=-1), sub[drafted]
            kl = (logp.exp() * (logp - logq)).sum(-1)
            losses.append((kl * covered).sum() / denoms[s - 1])
            if s == 1:
                top1 = (drafted == best).float()
                metrics = {"draft_loss": losses[0].detach(), "draft_top1": (top1 * m).sum() / denoms[0]}
                if sub is not None:
                    metrics["draft_vocab_cover"] = covered.sum() / denoms[0]
        return self.cfg.loss_weight * torch.stack(losses).mean(), metrics

    def observe(self, input_ids: torch.Tensor, prompt_len: int, mask: torch.Tensor) -> None:
        """Count a step's training targets (the response tokens the head learns to draft, those of
        ``mask [B, R]`` after the first) and refresh the subset of a reduced draft vocabulary from
        the running counts, before the step's passes. Every rank sees the whole batch here, so
        the replicas' subsets agree."""
        if self.head.subset() is None:
            return
        targets = input_ids[:, prompt_len + 1:]
        self.head.count(targets[mask[:, 1:].to(targets.device).bool()])

    def update(self, reduce: Callable[[list[torch.nn.Parameter]], None] | None = None) -> None:
        """One optimizer step on the gradients the losses left; ``reduce(params)`` first sums them
        over the ranks that trained on other rows (so every replica takes the same step)."""
        self._adopt()
        params = list(self.head.parameters())
        if reduce is not None:
            reduce(params)
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def _adopt(self) -> None:
        """Before the first RL update: the warm start's AdamW state if this head starts from the
        warm start's weights (a fresh state's first steps, of about ``lr`` on every weight, undo
        much of what the warm start taught; an unrelated head keeps its fresh state)."""
        warm, self._warm = self._warm, None
        if warm is None:
            return
        state = dict(self.head.named_parameters())  # not the vocabulary counts, which this step added to
        if state.keys() == warm[0].keys() and all(torch.equal(state[k], warm[0][k].to(state[k].device)) for k in state):
            self.optim.load_state_dict(warm[1])

    def save(self, path: str) -> None:
        torch.save(self.optim.state_dict(), os.path.join(path, OPTIM_FILE))

    def load(self, path: str) -> None:
        """The optimizer state saved beside a checkpoint (the head's weights come with the model's)."""
        self._warm = None  # a checkpoint's own state wins
        file = os.path.join(path, OPTIM_FILE)
        if os.path.exists(file):  # weights_only: a planted file cannot run code
            self.optim.load_state_dict(torch.load(file, weights_only=True))


class DraftTraining(HeadTraining):
    """The head of the Hugging Face ``model`` (attached if missing) and its optimizer."""

    def __init__(self, cfg: DraftConfig, model: torch.nn.Module, supervised: bool = False):
        super().__init__(cfg, attach(model, cfg.vocab), supervised)

    def step(self, model: torch.nn.Module, batch: Any) -> dict[str, float]:
        """``passes`` optimizer steps of the head on ``batch`` (a ``miles.Batch`` of token rows), the
        policy's forward run once; the metrics are the first pass's."""
        if not self.active or batch.input_ids is None or batch.attention_mask.dim() != 2:
            return {}
        P, R = batch.prompt_len, batch.input_ids.shape[1] - batch.prompt_len
        if R < 2:
            return {}
        with torch.no_grad():
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids, use_cache=False, output_hidden_states=True,
                        logits_to_keep=R)
            hidden = out.hidden_states[-1][:, :-1].detach()  # h_j, j = 0 .. L-2
            target = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)  # policy at columns P .. L-2
        mask, ids = batch.loss_mask.to(hidden.device), batch.input_ids
        self.observe(ids, P, mask)
        index = (P - 1 + torch.arange(R, device=ids.device)).expand(ids.shape[0], R)
        embedding, lm_head = embedding_weight(model), lm_weight(model)
        denoms, keys = denominators(mask, self.cfg.unroll), batch.attention_mask[:, :-1]
        first: dict[str, torch.Tensor] = {}
        for _ in range(self.passes):
            self.optim.zero_grad(set_to_none=True)
            loss, metrics = self.loss(hidden, ids[:, 1:], index, target, mask, embedding, lm_head, denoms, keys=keys)
            loss.backward()
            self.update()
            first = first or metrics
        return {k: float(v) for k, v in first.items()}
