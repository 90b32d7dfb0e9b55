"""Speculative decoding on the model's own forward with its multi-token-prediction layer
(``engine.speculative: {draft: mtp, tokens: k}``, architectures that carry MTP layers:
DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5/3.6 MoE).

A step drafts ``k`` tokens per row by chaining the first MTP layer on its own output, DeepSeek's
way: from the target's hidden state ``h_i`` and token ``t_{i+1}`` it predicts ``t_{i+2}``, then
from its own hidden state and that draft the next one. The target verifies the row's last token
and the drafts in one forward of ``k + 1`` positions, and rejection sampling (``rejection.py``, the
fast path's) keeps exactly the target's distribution; the returned log-probs are the target's.

The MTP layer attends causally over its own entries, so it keeps a KV cache of one entry per
position, built from the target's hidden states of the tokens that stay (the prompt's at prefill,
a step's accepted ones at the next step); the entries the chain adds from its own hidden states are
cropped after the step. The rows of a chunk decode together: a rejected position stays in the
target's cache as a hole the attention mask hides (transformers builds the causal mask from the
padding mask, as for left padding), and the positions every row rejected are cropped
(``Cache.crop``), so a row decoding alone keeps no holes. Gated-DeltaNet layers (Qwen3-Next,
Qwen3.5) hold a convolution window and a recurrent state instead, with no positions a mask could
hide: the verify forward records their state after each of the block's tokens and every row keeps
the one after exactly its accepted tokens (``LinearStates``). Other cache layers (sliding-window,
indexed attention) are refused.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from miles import ConfigError, SamplingParams
from miles_mtp import attention_mask

from .engine import _left_pad, _repeat_cache, _sample
from .rejection import acceptance, propose_token, sampling_probs, verify
from .spec_meta import spec_counts
from .speculative import auto_max_batch

_KEY = "engine.speculative.draft"


# why a cache layer kind cannot take a step's rejected drafts back
_REFUSED = {
    "DynamicSlidingWindowLayer": "sliding-window attention: its window counts cache slots, so the holes rejected "
                                 "drafts leave in a batch would shorten it, and keys that slid out of it cannot be "
                                 "cropped back",
}


def _rollback_problem(model: torch.nn.Module) -> str | None:
    """Why the model's decode cache cannot hide or roll back rejected positions (None: it can)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

    kinds = sorted({type(layer).__name__ for layer in DynamicCache(config=model.config).layers
                    if type(layer) not in (DynamicLayer, LinearAttentionLayer)})
    if kinds:
        why = "; ".join(f"{kind} layers ({_REFUSED.get(kind, 'a layer kind the rollback here does not cover')})"
                        for kind in kinds)
        return f"the model's cache cannot roll rejected draft tokens back: {why}"
    return None


class LinearStates:
    """The linear-attention (gated DeltaNet) layers of a decode cache, rolled back row by row.

    Their convolution window and recurrent state have no positions a mask could hide, so after a
    step each row needs the state after exactly its accepted tokens. With transformers' past
    recording on, the verify forward keeps the window's whole history and runs the block through
    the recurrent kernel token by token (single-token decoding's kernel), recording the state after
    each; ``keep`` takes every row's own, so a rejection costs no extra forward."""

    def __init__(self, cache: Any, block: int):
        from transformers.cache_utils import LinearAttentionLayer

        self.block = block
        self.layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionLayer)]
        for layer in self.layers:
            layer.activate_past_recording(recurrent_states_to_keep=block)

    def keep(self, fed: torch.Tensor, dropped: int) -> None:
        """Each row's states after the first ``fed[b]`` (1 to ``block``) tokens of the verify block;
        ``dropped`` positions leave the cache's length, as the attention layers' crop."""
        rows = torch.arange(fed.shape[0], device=fed.device)
        for layer in self.layers:
            for i in range(layer.number_of_states):
                if layer.is_conv_states_initialized[i]:
                    # [B, C, K + block]: the window before the block, then the block's inputs
                    conv, width = layer.conv_states[i], layer.conv_kernel_size[i]
                    at = (fed[:, None] + torch.arange(width, device=fed.device))[:, None].expand(-1, conv.shape[1], -1)
                    layer.conv_states[i] = conv.gather(-1, at)
                if layer.is_recurrent_states_initialized[i]:
                    history = layer.recurrent_states_history[i]  # the states after 0 .. block - 1 tokens
                    if len(history) != self.block:
                        raise RuntimeError(f"the verify forward recorded {len(history)} recurrent states of a "
                                           f"{self.block}-token block: this model's linear attention does not "
                                           f"record its past (transformers' activate_past_recording)")
                    states = torch.stack([*history, layer.recurrent_states[i]])
                    layer.recurrent_states[i].copy_(states[fed, rows])  # in place: its address stays
                    layer.recurrent_states_history[i] = []
            layer.cumulative_length_linear.sub_(dropped)

    def crop(self, cache: Any, tokens: int) -> None:
        """Drop the last ``tokens`` positions of the cache's attention layers (``keep`` rolls back the
        linear ones)."""
        mine = {id(layer) for layer in self.layers}
        for layer in cache.layers:
            if id(layer) not in mine:
                layer.crop(-tokens)


class MTPGenerator:
    """Drafts from the model's first MTP layer, verified by the model's own forward."""

    def __init__(self, model: torch.nn.Module, layer: torch.nn.Module, k: int, max_batch: int, cache_kw: str):
        self.model, self.layer, self.k, self.max_batch = model, layer, k, max_batch
        self.cache_kw = cache_kw
        self.totals = {"steps": 0, "emitted": 0, "accepted": 0}  # row-steps; drained by the engine
        self.accept_rate: float | None = None  # drafts accepted / drafted in the last generate call

    def drain(self) -> dict[str, float]:
        """``spec_accept_len`` and ``spec_accept_rate`` since the last call (``rejection.acceptance``)."""
        totals, self.totals = self.totals, {"steps": 0, "emitted": 0, "accepted": 0}
        return acceptance(totals, self.k)

    def _target(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """The target's final hidden states ``[B, T, d]`` of ``ids`` and its cache."""
        out = self.model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                               **({self.cache_kw: cache} if cache is not None else {}))
        return out.last_hidden_state, getattr(out, self.cache_kw)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams, gen: torch.Generator,
                 stop: torch.Tensor, pad_id: int, interrupt: Any,
                 fed: list[torch.Tensor] | None = None) -> tuple[tuple[torch.Tensor, ...], list[dict]]:
        """``n`` samples per prompt (adjacent rows): their tokens and log-probs ``[rows, T]``, lengths,
        whether each stopped, and whether ``interrupt`` cut the call short (``TorchEngine._completions``'s
        arguments); and each row's ``spec_meta.spec_counts`` (its verify steps and drafts). ``fed``
        (routing replay, ``RoutingLog.run_verified``) gets, per verify forward, each row's count of
        leading block positions that stay fed: the tokens it emitted that step, as the block's
        position ``i`` feeds the token before its ``i``-th emitted one."""
        from transformers.cache_utils import DynamicCache

        model, layer, k, steps = self.model, self.layer, self.k, params.max_new_tokens
        rotary, head, dtype = model.model.rotary_emb, model.lm_head, next(model.parameters()).dtype
        ids, mask = _left_pad(prompts, pad_id, next(model.parameters()).device)
        pos, mask = (mask.cumsum(-1) - 1).clamp(min=0), mask.bool()
        hidden, cache = self._target(ids, mask, pos, None)
        logits = head(hidden[:, -1]).repeat_interleave(n, dim=0)
        cache = _repeat_cache(cache, n, ids.shape[0])
        linear = LinearStates(cache, k + 1)
        hidden, ids, mask, pos = (t.repeat_interleave(n, dim=0) for t in (hidden, ids, mask, pos))
        rows, dev = ids.shape[0], ids.device
        tok, lp = _sample(logits, params, gen)  # the first token as plain sampling draws it
        tokens = torch.zeros((rows, steps + k + 1), dtype=torch.long, device=dev)
        logps = torch.zeros((rows, steps + k + 1), dtype=torch.float32, device=dev)
        tokens[:, 0], logps[:, 0] = tok, lp
        count = torch.ones(rows, dtype=torch.long, device=dev)
        row_steps = torch.zeros(rows, dtype=torch.long, device=dev)  # verify steps each row took part in
        row_accepted = torch.zeros(rows, dtype=torch.long, device=dev)
        done = torch.isin(tok, stop)
        at, j = torch.arange(rows, device=dev), torch.arange(k + 1, device=dev)
        # the target's cache slots that hold a token (holes: rejected drafts) and the next position
        tmask, length = mask, mask.sum(1)
        # MTP entries not yet in its cache: the target's hidden state at position i, token i + 1
        # (left padding's hidden states zeroed: no garbage among the MTP cache's masked keys)
        pend_h = torch.where(mask[..., None], hidden, torch.zeros_like(hidden))
        pend_t, pend_ok, pend_pos = torch.cat([ids[:, 1:], tok[:, None]], 1), mask, pos
        mcache, mmask = DynamicCache(), mask[:, :0]
        temp = params.temperature if params.temperature > 0 else 1.0
        aborted, before = False, dict(self.totals)
        while True:
            active = ~done & (count < steps)
            if not bool(active.any()):
                break
            if interrupt.is_set():
                aborted = True
                break
            # drafts: the pending entries, then the chain on the layer's own hidden states
            width = pend_h.shape[1]
            mmask = torch.cat([mmask, pend_ok], 1)
            h, lg = layer.step(pend_h, pend_t, rotary, pend_pos, attention_mask(mmask, width, dtype), mcache)
            last = width - 1 - pend_ok.flip(1).long().argmax(1)  # each row's last real entry
            feat, draft_logits = h[at, last], lg[at, last]
            drafts, qs = [], []
            for i in range(k):
                d, q = propose_token(draft_logits, params, gen)
                drafts.append(d)
                qs.append(q)
                if i + 1 < k:
                    mmask = torch.cat([mmask, mmask.new_ones((rows, 1))], 1)
                    h, lg = layer.step(feat[:, None], d[:, None], rotary, (length + i)[:, None],
                                       attention_mask(mmask, 1, dtype), mcache)
                    feat, draft_logits = h[:, 0], lg[:, 0]
            drafts_t = torch.stack(drafts, 1)
            q = None if qs[0] is None else torch.stack(qs, 1)
            # verify: the last token and the drafts as one block of the target
            tmask = torch.cat([tmask, tmask.new_ones((rows, k + 1))], 1)
            hidden, cache = self._target(torch.cat([tok[:, None], drafts_t], 1), tmask, length[:, None] + j, cache)
            logits = head(hidden).float()
            out, accepted = verify(logits if q is None else sampling_probs(logits, params), q, drafts_t, gen)
            lps = torch.log_softmax(logits / temp, dim=-1).gather(-1, out[..., None]).squeeze(-1)
            # emitted: up to the first rejection, the first stop token and the row's token budget
            keep = (j <= accepted[:, None]) & active[:, None]
            hit = keep & torch.isin(out, stop)
            first_stop = torch.where(hit.any(1), hit.float().argmax(1), k + 1)
            keep &= (j <= first_stop[:, None]) & (j < (steps - count)[:, None])
            emitted = keep.sum(1)
            if fed is not None:
                fed.append(emitted)
            cols = torch.where(keep, count[:, None] + j, tokens.shape[1] - 1)  # the last column: scratch
            tokens.scatter_(1, cols, out)
            logps.scatter_(1, cols, lps)
            count += emitted
            done |= first_stop < emitted
            self.totals["steps"] += int(active.sum())
            self.totals["emitted"] += int(emitted.sum())
            self.totals["accepted"] += int(accepted[active].sum())
            row_steps += active
            row_accepted += torch.where(active, accepted, 0)
            # roll back: the chain's MTP entries, and the target's positions every row rejected
            if k > 1:
                mcache.crop(-(k - 1))
                mmask = mmask[:, :-(k - 1)]
            kept = j <= accepted[:, None]
            tmask[:, -(k + 1):] = kept
            most = int(accepted.max())
            linear.keep(accepted + 1, k - most)
            if most < k:
                linear.crop(cache, k - most)
                tmask = tmask[:, :most - k]
            pend_h, pend_t, pend_ok = hidden[:, :most + 1], out[:, :most + 1], kept[:, :most + 1]
            pend_pos = length[:, None] + j[:most + 1]
            tok = out[at, accepted]
            length = length + accepted + 1
        ran = self.totals["steps"] - before["steps"]
        if ran:
            self.accept_rate = (self.totals["accepted"] - before["accepted"]) / (ran * k)
        width = int(count.max())
        counts = [spec_counts(s, a, k) for s, a in zip(row_steps.tolist(), row_accepted.tolist())]
        return (tokens[:, :width], logps[:, :width], count, done, aborted), counts


def setup_mtp(cfg: Any, model: torch.nn.Module, spec: Any, cache_kw: str) -> MTPGenerator:
    """The ``mtp`` draft of ``engine.speculative`` on the model's own forward; refused (naming
    ``engine.speculative.draft``) for an architecture without MTP layers or with a cache that
    cannot roll rejected drafts back (sliding-window or indexed attention layers)."""
    from miles.protocols import CarriesMTP, KnowsArchitecture
    from miles_mtp import mtp_layers

    if not isinstance(spec, KnowsArchitecture):
        raise ConfigError([f"{_KEY}: mtp drafts with the model's multi-token-prediction layers, which this "
                           f"model spec does not attach (model.name: hf and miles serve's folders do, for "
                           f"deepseek_v3, glm4_moe, qwen3_next and qwen3_5_moe_text); use draft: head or model"])
    if not isinstance(spec.architecture(), CarriesMTP):
        name = getattr(model.config, "model_type", type(model).__name__)
        raise ConfigError([f"{_KEY}: mtp drafts with the model's multi-token-prediction layers, and {name} "
                           f"carries none (deepseek_v3, glm4_moe, qwen3_next and qwen3_5_moe_text do); "
                           f"use draft: head or model"])
    layers = mtp_layers(model)
    if not layers:
        raise ConfigError([f"{_KEY}: mtp needs the model's MTP layers, and its config has "
                           f"num_nextn_predict_layers (Qwen3-Next, Qwen3.5: mtp_num_hidden_layers) 0; "
                           f"use draft: head or model"])
    problem = _rollback_problem(model)
    if problem is not None:
        raise ConfigError([f"{_KEY}: mtp: {problem}; remove engine.speculative"])
    limit = cfg.speculative.max_batch
    if limit == "auto":  # both sides run eagerly here (no CUDA graphs): the fast path's rule with graphs
        limit = auto_max_batch(next(model.parameters()).device, cuda_graphs=True)
    return MTPGenerator(model, layers[0], cfg.speculative.tokens, limit, cache_kw)
