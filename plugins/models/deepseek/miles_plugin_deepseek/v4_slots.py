"""DeepSeek-V4's attention cache in the engine's cache rows, so the engine batches V4 continuously.

transformers' V4 cache grows by whole compressed windows per call: its compressors buffer tokens
until a window of ``compress_rate`` closes, then emit one entry. Rows at different positions close
windows at different steps, which one batched step cannot do with that cache. Here each row keeps
fixed-size state instead, and a decode step is the same for every row:

- the sliding-window keys (K = V) at every position, the window applied by the engine's mask;
- per compressor (and CSA's indexer), the kv and gate of the row's current and previous window
  (indexed by window parity), written at the token's slot; the current window's entry is
  recomputed at every step from the slots filled so far and written at its index. Entries of
  windows not yet closed stay masked, so an entry is read only once its window is complete, when
  it equals what transformers emits;
- CSA's entry ``w`` pools window ``w - 1``'s first half (Ca) with window ``w``'s second half (Cb),
  as transformers does through its overlap state.

Prompts of any lengths prefill together, right-padded from position 0: every real token's output is
exact (padding only ever follows it), and each row loads its own length from the keys and
projections the prefill's transformers cache recorded (``watch``), the padded tail left for decode
to overwrite.

The compressor and indexer modules of the engine's model instance get a forward that takes this
path when the cache layer is a ``V4SlotLayer`` and transformers' own otherwise (prefill, scoring,
training).
"""
from __future__ import annotations

import types
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4CSACompressor,
    apply_rotary_pos_emb,
)


class _Series:
    """One compressor's per-row state: window slots ``[rows, 2, rate, features]`` (kv in the
    model's dtype; gate with the position bias added in the model's dtype, as transformers adds it,
    kept in float32) and entries ``[rows, T, dim]``."""

    def __init__(self, module: torch.nn.Module, slots: int, max_len: int, dtype: torch.dtype, device: Any):
        self.rate, self.dim = module.compress_rate, module.head_dim
        features = module.kv_proj.out_features
        self.overlap = features == 2 * self.dim  # CSA and its indexer pool two windows
        self.kv = torch.zeros((slots, 2, self.rate, features), dtype=dtype, device=device)
        self.gate = torch.zeros((slots, 2, self.rate, features), dtype=torch.float32, device=device)
        self.entries = torch.zeros((slots, max_len // self.rate + 1, self.dim), dtype=dtype, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.kv, self.gate, self.entries]

    def step(self, m: torch.nn.Module, hidden: torch.Tensor, pos: torch.Tensor, count: int) -> torch.Tensor:
        """Write the token at ``pos`` (one per row), refresh its window's entry; the rows' first
        ``count`` entries ``[B, count, dim]``."""
        b = hidden.shape[0]
        rows = torch.arange(b, device=pos.device)
        window, slot = pos // self.rate, pos % self.rate
        cur, prev = window % 2, (window + 1) % 2
        self.kv[rows, cur, slot] = m.kv_proj(hidden)[:, 0]
        self.gate[rows, cur, slot] = (m.gate_proj(hidden)[:, 0] + m.position_bias[slot]).float()
        later = torch.arange(self.rate, device=pos.device)[None, :] > slot[:, None]  # slots not yet written
        kv, gate = self.kv[rows, cur], self.gate[rows, cur].masked_fill(later[..., None], float("-inf"))
        if self.overlap:  # window w - 1's Ca (none before the first window), then window w's Cb
            d = self.dim
            prev_gate = self.gate[rows, prev, :, :d].masked_fill((window == 0)[:, None, None], float("-inf"))
            kv = torch.cat([self.kv[rows, prev, :, :d], kv[..., d:]], dim=1)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        entry = m.kv_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))[:, None]
        cos, sin = m.rotary_emb(entry, position_ids=(window * self.rate)[:, None], layer_type=m.rope_layer_type)
        entry = apply_rotary_pos_emb(entry.unsqueeze(1), cos, sin).squeeze(1)
        self.entries[rows, window] = entry[:, 0]
        return self.entries[:b, :count]

    def load(self, seen: tuple[torch.Tensor, torch.Tensor], done: torch.Tensor | None, m: torch.nn.Module,
             rows: torch.Tensor, group: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prompts prefilled right-padded from position 0 into ``rows`` (``group``: each row's
        prompt, of ``lengths[group]`` tokens): ``seen``, the compressor's kv and gate projections
        at every padded position; ``done``, transformers' entries of the padded width's windows.
        Slots and entries past a row's prompt hold padding, which decode overwrites before a
        query reads it (a slot is read once written, an entry once its window closes)."""
        kv, gate = seen
        width = kv.shape[1]
        window = lengths[group] // self.rate
        t = torch.arange(self.rate, device=kv.device)
        for w in (window, window - 1):  # the row's current window and the one before (-1: none, masked)
            at = (w[:, None] * self.rate + t).clamp(0, width - 1)
            self.kv[rows, w % 2] = kv[group[:, None], at].to(self.kv.dtype)
            self.gate[rows, w % 2] = (gate[group[:, None], at] + m.position_bias).float()
        if done is not None and done.shape[1]:
            self.entries[rows, :done.shape[1]] = done[group].to(self.entries.dtype)

    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for t in self.tensors():
            t[dst] = t[src]


class V4SlotLayer(CacheLayerMixin):
    """A V4 layer's cache rows: sliding keys (K = V) at every position, and its compressors'
    series (see the module docstring). ``step``: the engine's decode step (rows' positions and
    the key length read); ``window``: the keys each query may see, as the engine's mask applies it."""

    is_compileable = False
    is_sliding = True

    def __init__(self, attention: torch.nn.Module, step: Any, slots: int, max_len: int, dtype: torch.dtype,
                 device: Any):
        super().__init__()
        self.attention, self.step, self.window = attention, step, attention.sliding_window
        self.keys = torch.zeros((slots, 1, max_len, attention.head_dim), dtype=dtype, device=device)
        self.values = self.keys
        self.is_initialized = True
        comp = attention.compressor
        self.series: dict[str, _Series] = {}
        if comp is not None:
            self.series["compressor"] = _Series(comp, slots, max_len, dtype, device)
        if isinstance(comp, DeepseekV4CSACompressor):
            self.series["indexer"] = _Series(comp.indexer, slots, max_len, dtype, device)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocated up front."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        s = self.step
        b = key_states.shape[0]
        self.keys[:b].scatter_(2, s.pos.view(b, 1, 1, 1).expand_as(key_states), key_states)
        keys = self.keys[:b, :, :s.length]
        return keys, keys

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.length, 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def entries(self) -> int:
        """Compressed entries a decode step reads: every window that may hold a position below the
        step's key length (static per length, as a CUDA graph needs)."""
        rate = next(iter(self.series.values())).rate
        return self.step.length // rate + 1

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys] + [t for s in self.series.values() for t in s.tensors()]

    def watch(self, layer: Any) -> None:
        """Before a prefill forward: transformers' V4 cache ``layer`` (of a ``DynamicCache`` for
        the model) records the full keys and each compressor's projections, which ``load`` reads
        (transformers keeps only the padded width's last window of them)."""
        seen: dict[str, Any] = {}
        update = layer.update

        def recorded_update(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            seen["keys"] = key_states
            return update(key_states, value_states, *args, **kwargs)

        layer.update, layer.miles_seen = recorded_update, seen
        if self.series:
            store = layer.store_compression_weights

            def recorded_store(name: str, kv: torch.Tensor, gate: torch.Tensor):
                seen[name] = (kv, gate)
                return store(name, kv, gate)

            layer.store_compression_weights = recorded_store

    def load(self, layer: Any, rows: torch.Tensor, group: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prompts right-padded from position 0 and prefilled through ``layer`` (``watch``ed),
        into ``rows`` (``group``: each row's prompt, of ``lengths[group]`` tokens)."""
        seen = layer.miles_seen
        keys = seen["keys"]  # [prompts, 1, width, dim]; past a prompt's end, decode overwrites them
        self.keys[rows, :, :keys.shape[2]] = keys[group].to(self.keys.dtype)
        comp = self.attention.compressor
        for name, series in self.series.items():
            series.load(seen[name], layer.compressed_kv[name], comp if name == "compressor" else comp.indexer,
                        rows, group, lengths)

    def move(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        self.keys[dst, :, :length] = self.keys[src, :, :length]
        for s in self.series.values():
            s.move(dst, src)


def _compressor_forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
    layer = cache.layers[layer_idx] if cache is not None else None
    if not isinstance(layer, V4SlotLayer):
        return type(self).forward(self, hidden_states, q_residual, position_ids, cache, layer_idx)
    pos = layer.step.pos
    count = layer.entries()
    entries = layer.series["compressor"].step(self, hidden_states, pos, count)  # [B, T, dim]
    b = entries.shape[0]
    ready = (pos + 1) // self.compress_rate  # closed windows
    visible = torch.arange(count, device=pos.device)[None, :] < ready[:, None]  # [B, T]
    if "indexer" in layer.series:
        visible = visible & _chosen(self.indexer, layer, hidden_states, q_residual, pos, count, ready)
    bias = torch.zeros((b, 1, 1, count), dtype=entries.dtype, device=entries.device)
    return entries.unsqueeze(1), bias.masked_fill_(~visible[:, None, None, :], float("-inf"))


def _chosen(m, layer: V4SlotLayer, hidden: torch.Tensor, q_residual: torch.Tensor, pos: torch.Tensor,
            count: int, ready: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: the closed entries the Lightning Indexer picks (its top ``index_topk``)."""
    keys = layer.series["indexer"].step(m, hidden, pos, count)  # [B, T, index dim]
    b = hidden.shape[0]
    cos, sin = m.rotary_emb(hidden, position_ids=pos[:, None], layer_type=m.rope_layer_type)
    q = m.q_b_proj(q_residual).view(b, 1, -1, m.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)
    scores = m.scorer(q, keys, hidden)[:, 0]  # [B, T]
    closed = torch.arange(count, device=pos.device)[None, :] < ready[:, None]
    scores = scores.masked_fill(~closed, float("-inf"))
    top = scores.topk(min(m.index_topk, count), dim=-1).indices
    return torch.zeros_like(closed).scatter_(1, top, True)


def slot_layers(model: torch.nn.Module, step: Any, slots: int, max_len: int) -> list[V4SlotLayer]:
    """A ``V4SlotLayer`` per decoder layer of ``model`` (its compressors switched to the slot
    path when they see one)."""
    attn = [m for m in model.modules() if isinstance(m, DeepseekV4Attention)]
    weight = model.lm_head.weight
    for a in attn:
        if a.compressor is not None and "forward" not in vars(a.compressor):
            a.compressor.forward = types.MethodType(_compressor_forward, a.compressor)
    return [V4SlotLayer(a, step, slots, max_len, weight.dtype, weight.device) for a in attn]
