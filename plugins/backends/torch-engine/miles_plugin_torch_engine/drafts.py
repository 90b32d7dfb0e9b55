"""Drafts for speculative decoding: what proposes the ``k`` tokens a step verifies.

Both keep per-row state in cache-row order (the scheduler's rows; ``move`` follows its packing):
the head, the target's hidden state before the row's last token (its drafting input) and its
attention's KV cache; the draft model, its own KV cache and the token before the last one. After
a step emitting ``n`` tokens a row's last token sits at ``pos + n``; the draft model's cache then
holds every position up to ``pos + n - 2`` at least, so its next proposal feeds that token and
the last one as a block (rewriting a position it may already hold, with the same token and keys).

``propose`` takes the uniforms of its draws (``u [B, k]``) and an attention length bucket when it
runs inside a CUDA graph (``spec_graphs``); ``signature`` names the state buffers such a graph
reads, so that it is captured again when they are re-allocated.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from miles import ConfigError
from miles_draft.head import attach, attend, embed, head_logits, lm_weight

from .fast import LlamaFamilyForward, unsupported_reason
from .rejection import propose_token
from .speculative import forward_block, lm_logits


class HeadDrafter:
    """The EAGLE-style head attached to the engine's model (``draft_head.``), so weight syncs
    update it with the policy's weights. Its attention keeps a KV cache of its own, one entry per
    position in the target's positions: the entry of position ``j`` fuses the target's hidden
    state at ``j`` with the token at ``j + 1`` (``DraftHead.chains``, which training runs). A
    proposal writes the entry before the row's last token and then the chain's own entries after
    it; ``commit`` rewrites the entries of the tokens a step emitted from the verify block's
    hidden states, so the cache below a row's last token holds only the target's.

    With a reduced draft vocabulary (the head's ``draft_vocab``, ``draft.vocab``) the head scores
    only the subset's rows of the LM head, gathered into a buffer of their own at every generate
    call (after a weight sync), refilled in place so that captured graphs stay valid; drafts map
    back to target ids and their distribution is zero outside the subset, which rejection
    sampling's residual covers."""

    reads_length = True  # its attention reads cache positions below the step's length bucket

    def __init__(self, model: torch.nn.Module, path: str | None):
        self.model, self.head = model, attach(model)
        if path:
            from miles_draft.files import load_head

            load_head(self.head, path)
        self.feat: torch.Tensor | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.ids: torch.Tensor | None = None  # the subset's target ids [N] (None: every token)
        self.lm: torch.Tensor | None = None  # their LM head rows [N, d]

    def allocate(self, fwd: LlamaFamilyForward) -> None:
        if self.feat is None or self.feat.shape[0] != fwd.slots:
            self.feat = torch.zeros((fwd.slots, self.model.config.hidden_size), dtype=fwd.dtype, device=fwd.device)
        shape = (fwd.slots, fwd.max_len, self.head.heads, self.head.head_dim)
        if self.k_cache is None or self.k_cache.shape != shape:
            self.k_cache = torch.zeros(shape, dtype=fwd.dtype, device=fwd.device)
            self.v_cache = torch.zeros(shape, dtype=fwd.dtype, device=fwd.device)
        self._gather_vocab()

    def _gather_vocab(self) -> None:
        """The subset's ids and LM head rows from the head's ``draft_vocab`` and the current weights."""
        sub = self.head.subset()
        if sub is None:
            self.ids = self.lm = None
            return
        w = lm_weight(self.model)
        if self.ids is None or self.ids.shape != sub.shape or self.lm.dtype != w.dtype or self.lm.device != w.device:
            self.ids = torch.empty_like(sub)
            self.lm = torch.empty((sub.numel(), w.shape[1]), dtype=w.dtype, device=w.device)
        self.ids.copy_(sub)
        torch.index_select(w, 0, self.ids, out=self.lm)

    def signature(self) -> tuple:
        # the head's weights are the model's: in the forward's signature
        vocab = () if self.ids is None else (self.ids.data_ptr(), self.lm.data_ptr())
        return (self.feat.data_ptr(), self.k_cache.data_ptr(), self.v_cache.data_ptr(), *vocab)

    def _propose_token(self, feature: torch.Tensor, params: Any, gen: torch.Generator,
                       u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft (target id) from a head output feature and its distribution over the target's vocabulary."""
        if self.ids is None:
            return propose_token(head_logits(self.model, feature), params, gen, u)
        tok, q = propose_token(F.linear(feature, self.lm), params, gen, u)
        if q is not None:  # over the target's vocabulary: zero outside the subset
            q = torch.zeros((*q.shape[:-1], self.head.draft_vocab.numel()), dtype=q.dtype,
                            device=q.device).index_copy_(-1, self.ids, q)
        return self.ids[tok], q

    def state(self) -> tuple[torch.Tensor, ...]:
        """Per-row state a step overwrites (its cache entries at and past a row's position are
        rewritten before they are read)."""
        return (self.feat,)

    def _write(self, slots: torch.Tensor, at: torch.Tensor, feature: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """Entries of ``feature [..., d]`` and the token after it at positions ``at`` of cache rows
        ``slots`` (broadcast alike); the entry's ``(x, q)``."""
        x, q, k, v = self.head.project(feature, embed(self.model, tok))
        at = at.clamp(max=self.k_cache.shape[1] - 1)
        self.k_cache[slots, at] = k
        self.v_cache[slots, at] = v
        return x, q

    def join(self, rows, features, prev, ids, lengths, repeats, hidden) -> None:
        """A prefill's rows: ``hidden [P, T, d]`` the prompts' states (right-padded), ``features``
        each row's state before its last token; the entries of positions ``0 .. T - 2`` (those at
        and past a prompt's last token are rewritten before they are read)."""
        self.feat[rows] = features
        T = ids.shape[1]
        if T < 2:
            return
        slots = rows[:, None]
        at = torch.arange(T - 1, device=ids.device)[None]
        rep = lambda t: t.repeat_interleave(repeats, dim=0)  # noqa: E731
        self._write(slots, at, rep(hidden[:, :T - 1]), rep(ids[:, 1:]))

    def move(self, dst: torch.Tensor, src: torch.Tensor, need: int) -> None:
        self.feat[dst] = self.feat[src]
        self.k_cache[dst, :need] = self.k_cache[src, :need]
        self.v_cache[dst, :need] = self.v_cache[src, :need]

    def commit(self, live: int, hidden: torch.Tensor, tokens: torch.Tensor, n: torch.Tensor,
               pos: torch.Tensor, prev: torch.Tensor) -> None:
        """After a step from positions ``pos`` that emitted ``n`` of the block's ``tokens``: the
        entries of positions ``pos .. pos + k - 1`` from the block's ``hidden [live, k + 1, d]``
        (those of the ``n - 1`` tokens before the new last one are the target's; the rest sit at or
        past the new last position and are rewritten before they are read); the new last state."""
        at = torch.arange(live, device=hidden.device)
        self.feat[:live] = hidden[at, n - 1]
        k = tokens.shape[1] - 1
        self._write(at[:, None], pos[:, None] + torch.arange(k, device=pos.device), hidden[:, :k], tokens[:, :k])

    def propose(self, live: int, last: torch.Tensor, pos: torch.Tensor, k: int, params: Any,
                gen: torch.Generator, u: torch.Tensor | None = None,
                length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``k`` drafts per row ``[live, k]`` and the distributions they were drawn from ``[live, k, V]``
        (None at temperature 0). Step ``i`` writes its entry at position ``pos - 1 + i`` and attends
        the row's entries up to it (a graph's scratch rows sit at position 0: clamped)."""
        start = (pos - 1).clamp(min=0)
        length = int(start.max()) + k if length is None else length
        rows = torch.arange(live, device=pos.device)
        span = torch.arange(length, device=pos.device)
        feature, tok, drafts, qs = self.feat[:live], last, [], []
        for i in range(k):
            x, q = self._write(rows, start + i, feature, tok)
            o = attend(self.head, q, self.k_cache[:live, :length], self.v_cache[:live, :length],
                       span[None] <= (start + i)[:, None])
            feature = self.head.finish(x, o)
            tok, q = self._propose_token(feature, params, gen, None if u is None else u[:, i:i + 1])
            drafts.append(tok)
            qs.append(q)
        return torch.stack(drafts, 1), None if qs[0] is None else torch.stack(qs, 1)


class ModelDrafter:
    """A small Llama-family model with the target's vocabulary, on the fast path's forward."""

    def __init__(self, path: str, target: torch.nn.Module):
        from transformers import AutoModelForCausalLM

        ref = target.lm_head.weight
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=ref.dtype)
        except (OSError, ValueError) as e:
            raise ConfigError([f"engine.speculative.model_path: {path} is not a loadable model folder ({e})"]) from None
        reason = unsupported_reason(model)
        if reason is not None:
            raise ConfigError([f"engine.speculative.model_path: {path} cannot run on the fast path: {reason}"])
        if model.lm_head.weight.shape[0] != ref.shape[0]:
            raise ConfigError([f"engine.speculative.model_path: {path} has a vocabulary of "
                               f"{model.lm_head.weight.shape[0]} tokens, the model {ref.shape[0]}; a draft "
                               f"model needs the same tokenizer"])
        self.fwd = LlamaFamilyForward(model.to(ref.device).eval())
        self.prev: torch.Tensor | None = None

    @property
    def reads_length(self) -> bool:
        """Its forward reads cache positions below the step's length bucket (Triton's does not)."""
        return not self.fwd.use_triton

    def allocate(self, fwd: LlamaFamilyForward) -> None:
        self.fwd.allocate(fwd.slots, fwd.max_len)
        self.fwd.refresh()
        if self.prev is None or self.prev.shape[0] != fwd.slots:
            self.prev = torch.zeros(fwd.slots, dtype=torch.long, device=fwd.device)

    def signature(self) -> tuple:
        return self.fwd.weights_signature() + (self.fwd.k_cache.data_ptr(), self.prev.data_ptr())

    def state(self) -> tuple[torch.Tensor, ...]:
        return (self.prev,)

    def join(self, rows, features, prev, ids, lengths, repeats, hidden) -> None:
        self.fwd.prefill(ids, lengths, rows, repeats)
        self.prev[rows] = prev

    def move(self, dst: torch.Tensor, src: torch.Tensor, need: int) -> None:
        self.fwd.move_rows(dst, src, need)
        self.prev[dst] = self.prev[src]

    def commit(self, live: int, hidden: torch.Tensor, tokens: torch.Tensor, n: torch.Tensor,
               pos: torch.Tensor, prev: torch.Tensor) -> None:
        self.prev[:live] = prev

    def propose(self, live: int, last: torch.Tensor, pos: torch.Tensor, k: int, params: Any,
                gen: torch.Generator, u: torch.Tensor | None = None,
                length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # a live row's position is >= 1 (its prompt); a graph's scratch rows sit at 0
        hidden = forward_block(self.fwd, torch.stack([self.prev[:live], last], 1), (pos - 1).clamp(min=0),
                               length=length)[:, -1]
        drafts, qs = [], []
        for i in range(k):
            tok, q = propose_token(lm_logits(self.fwd, hidden), params, gen, None if u is None else u[:, i:i + 1])
            drafts.append(tok)
            qs.append(q)
            if i + 1 < k:
                hidden = forward_block(self.fwd, tok[:, None], pos + i + 1, length=length)[:, 0]
        return torch.stack(drafts, 1), None if qs[0] is None else torch.stack(qs, 1)


def make_drafter(spec: Any, model: torch.nn.Module, cfg: Any) -> HeadDrafter | ModelDrafter:
    if spec.draft == "head":
        return HeadDrafter(model, spec.path)
    return ModelDrafter(spec.model_path, model)
