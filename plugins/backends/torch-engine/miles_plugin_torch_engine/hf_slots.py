"""The model's own forward (``impl: hf``) under the fast path's scheduler: continuous batching.

The scheduler (``batching.FastGenerator``) gives every sample a cache row, lets waiting requests
join between decode steps and replays decode steps from CUDA graphs (``cuda_graphs.DecodeRunner``).
It asks its forward to prefill prompts into chosen rows, to decode rows ``[0, B)`` each at its own
position, and to move rows. ``HfSlotForward`` does that with the model's transformers forward for
every architecture whose cache layers transformers can hold statically (full, sliding-window,
DSA-indexed and linear-attention layers): one preallocated tensor per cached quantity, a row per
sample. A decode step writes each row's new keys at that row's position, and a 4-D mask shows each
row its own positions (and window), so rows of any length share the step. Linear-attention layers
hand the model views of the live rows' convolution and recurrent states, updated in place.

Prefill runs the model over the new prompts, left-padded, with transformers' own growing cache,
then copies each prompt's cached positions and states into its samples' rows (an architecture's
own slot layers take them right-padded from position 0 instead). Routing replay (R3) keeps a
``[rows, positions, layers, top_k]`` table of experts: the prefill writes the prompt's rows, each
decode step (inside its CUDA graph too) the fed token's position, and a finished sample takes its
row's first ``prompt + response - 1`` positions.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.cache_utils import (
    DynamicIndexedLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    StaticIndexedLayer,
    StaticLayer,
)

from .batching import FastGenerator
from .fast import RowsForward

_ATTENTION = ("keys", "values", "indexer_keys")  # per-position tensors a layer may hold


class _Step:
    """What the slot layers read during a decode step: the rows' positions and the key length."""
    pos: torch.Tensor
    length: int = 0


class SlotLayer(StaticLayer):
    """Keys and values ``[rows, heads, positions, dim]``; a step writes at each row's position."""

    def bind(self, step: _Step, held: dict[str, torch.Tensor]) -> None:
        self.step, self.keys, self.values = step, held["keys"], held["values"]
        self.device, self.is_initialized = self.keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        s = self.step
        b = key_states.shape[0]
        at = s.pos.view(b, 1, 1, 1)
        self.keys[:b].scatter_(2, at.expand_as(key_states), key_states)
        self.values[:b].scatter_(2, at.expand_as(value_states), value_states)
        return self.keys[:b, :, :s.length], self.values[:b, :, :s.length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.length, 0


class SlotIndexedLayer(SlotLayer):
    """A ``SlotLayer`` with DSA's indexer keys ``[rows, positions, dim]``."""

    def bind(self, step: _Step, held: dict[str, torch.Tensor]) -> None:
        super().bind(step, held)
        if "indexer_keys" in held:  # not in a layer that reuses another layer's top-k (GLM-5's "shared")
            self.indexer_keys, self.is_indexer_initialized = held["indexer_keys"], True

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        s = self.step
        b = indexer_key_states.shape[0]
        at = s.pos.view(b, 1, 1).expand_as(indexer_key_states)
        self.indexer_keys[:b].scatter_(1, at, indexer_key_states)
        return self.indexer_keys[:b, :s.length]


class SlotLinearLayer(LinearAttentionLayer):
    """Convolution and recurrent states ``[rows, ...]``; a step sees the live rows' views."""

    def bind(self, step: _Step, held: dict[str, torch.Tensor]) -> None:
        self.step, self.conv, self.recurrent = step, held["conv"], held["recurrent"]
        self.device, self.dtype = self.conv.device, self.conv.dtype
        self.cumulative_length_linear = self.cumulative_length_linear.to(self.device)
        self.conv_kernel_size[0] = self.conv.shape[-1]
        for flags in (self.is_conv_states_initialized, self.is_recurrent_states_initialized,
                      self.has_previous_state):
            flags[0] = True
        self.rows(self.conv.shape[0])

    def rows(self, b: int) -> None:
        self.conv_states[0], self.recurrent_states[0] = self.conv[:b], self.recurrent[:b]


_SLOT_CLASSES = {StaticLayer: SlotLayer, StaticIndexedLayer: SlotIndexedLayer, LinearAttentionLayer: SlotLinearLayer}


def slot_kinds(model: torch.nn.Module) -> list[str] | None:
    """The model's cache layer kinds when every one can live in slots (and its attention takes a
    4-D mask), else None: e.g. DeepSeek-V4's compressed attention, or a flash-attention backend."""
    from .hf_graphs import static_cache, static_layers

    if not static_layers(model) or model.config._attn_implementation not in ("sdpa", "eager"):
        return None
    from transformers.cache_utils import get_layer_types_and_kwargs

    kinds, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    if not all(type(layer) in _SLOT_CLASSES for layer in static_cache(model, 1).layers):
        return None
    return list(kinds)


class HfSlotForward(RowsForward):
    """The forward ``FastGenerator`` schedules (see the module docstring), over ``model``'s own
    modules; ``recorder`` (a ``miles.protocols.RecordsGraphReplays``) makes it keep routing."""

    def __init__(self, model: torch.nn.Module, kinds: list[str], cache_kw: str, recorder: Any = None,
                 arch: Any = None):
        """``cache_kw``: the name of the model forward's cache argument (the engine's ``_cache_kw``);
        ``arch``: a ``miles.protocols.OffersSlotLayers`` architecture that holds its layers' rows
        itself (its prompts prefill right-padded: it need not mask padding)."""
        self.model, self.kinds, self.recorder, self.arch = model, kinds, recorder, arch
        self.own: list[Any] = []  # the architecture's slot layers
        text = model.config.get_text_config(decoder=True)
        self.window = getattr(text, "sliding_window", None)
        self.eager = model.config._attn_implementation == "eager"
        self._cache_kw = cache_kw
        self.step = _Step()
        self.cache: Any = None
        self.held: list[dict[str, torch.Tensor]] = []  # per layer: its cached tensors by name
        self.linear: list[Any] = []  # the slot layers holding linear-attention states
        self.route: torch.Tensor | None = None  # [rows, positions, layers, top_k] experts
        self.slots = self.max_len = 0
        self.k_cache: torch.Tensor | None = None  # the first cached tensor (the graphs' cache identity)

    def saved_state(self) -> Callable[[], None] | None:
        """Linear-attention states advance in place at every step: a graph's warm-up run must not
        leave them one step ahead of the replay that follows."""
        if not self.linear:
            return None
        held = [(t, t.clone()) for h in self.held for name, t in h.items() if name in ("conv", "recurrent")]

        def restore() -> None:
            for t, saved in held:
                t.copy_(saved)
        return restore

    def refresh(self) -> None:
        """Nothing to copy: the forward reads the module's own weights."""

    def _run(self, ids: torch.Tensor, mask: Any, pos: torch.Tensor, cache: Any = None, keep: int = 1) -> Any:
        kw = {self._cache_kw: cache} if cache is not None else {}
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                          logits_to_keep=keep, **kw)

    def _recorded(self, ids: torch.Tensor, mask: Any, pos: torch.Tensor, cache: Any = None, keep: int = 1):
        """(model output, ``[tokens, layers, top_k]`` experts or None) of one forward; ``keep``:
        the positions the head sees (0: all)."""
        if self.recorder is None:
            return self._run(ids, mask, pos, cache, keep), None
        mark = self.recorder.mark()
        out = self._run(ids, mask, pos, cache, keep)
        entries = self.recorder.split_off(mark)
        return out, torch.stack(entries, dim=1) if entries else None

    def allocate(self, slots: int, max_len: int) -> None:
        """Rows and positions for the call; tensors only grow (a graph replays their addresses)."""
        if self.cache is not None and slots <= self.slots and max_len <= self.max_len:
            return
        slots, max_len = max(slots, self.slots), max(max_len, self.max_len)
        probe = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        out, routed = self._recorded(probe, None, probe)
        self.held, self.linear = [], []
        if self.arch is not None:
            from transformers.cache_utils import Cache

            self.own = self.arch.slot_layers(self.model, self.step, slots, max_len)
            self.cache = Cache(layers=self.own)
            self.k_cache = self.own[0].tensors()[0]
        else:
            self._static_slots(getattr(out, self._cache_kw), slots, max_len)
        self.route = None
        if routed is not None:
            self.route = torch.zeros((slots, max_len, *routed.shape[1:]), dtype=torch.int32, device=self.device)
        self.slots, self.max_len = slots, max_len
        self._positions = torch.arange(max_len, device=self.device)

    def _static_slots(self, grown: Any, slots: int, max_len: int) -> None:
        """transformers' static cache for the model, each layer replaced by its slot class over
        tensors shaped from ``grown`` (a 1-token forward's cache)."""
        from .hf_graphs import static_cache

        self.cache = static_cache(self.model, max_len)
        for i, layer in enumerate(self.cache.layers):
            src = grown.layers[i]
            if isinstance(src, LinearAttentionCacheLayerMixin):
                conv, rec = src.conv_states[0], src.recurrent_states[0]
                held = {"conv": torch.zeros((slots, *conv.shape[1:]), dtype=conv.dtype, device=conv.device),
                        "recurrent": torch.zeros((slots, *rec.shape[1:]), dtype=rec.dtype, device=rec.device)}
            else:  # keys and values [1, heads, 1, dim]; DSA's indexer keys [1, 1, dim]
                held = {name: torch.zeros((slots, *t.shape[1:-2], max_len, t.shape[-1]), dtype=t.dtype, device=t.device)
                        for name, t in (("keys", src.keys), ("values", src.values))}
                if isinstance(src, DynamicIndexedLayer) and src.is_indexer_initialized:  # not GLM-5's "shared"
                    t = src.indexer_keys
                    held["indexer_keys"] = torch.zeros((slots, max_len, t.shape[-1]), dtype=t.dtype, device=t.device)
            slot = _SLOT_CLASSES[type(layer)].__new__(_SLOT_CLASSES[type(layer)])
            slot.__dict__.update(layer.__dict__)
            slot.bind(self.step, held)
            self.cache.layers[i] = slot
            self.held.append(held)
            if "conv" in held:
                self.linear.append(slot)
        self.k_cache = next(iter(self.held[0].values()))

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, reps: torch.Tensor) -> torch.Tensor:
        """Last-position logits ``[prompts, V]`` of right-padded ``ids``; prompt ``g``'s cache goes
        into the next ``reps[g]`` of ``rows``."""
        group = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), reps)  # source prompt per row
        if self.own:
            return self._prefill_own(ids, lengths, rows, group)
        return self._prefill(ids, lengths, rows, group)

    def _prefill_own(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                     group: torch.Tensor) -> torch.Tensor:
        """The architecture's own slot layers: prompts stay right-padded from position 0 (an
        architecture that does not mask padding, as DeepSeek-V4's compressors pool windows by
        absolute position, computes every real token exactly so), through transformers' cache
        for the model with each layer ``watch``ed, then each slot layer loads its rows."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer, own in zip(cache.layers, self.own):
            own.watch(layer)
        width = ids.shape[1]
        last = torch.arange(len(lengths), device=ids.device), lengths - 1
        # the head sees each prompt's last real position only (the forward keeps every position)
        hook = self.model.get_output_embeddings().register_forward_pre_hook(
            lambda module, args: (args[0][last][:, None],))
        try:
            pos = torch.arange(width, device=ids.device)[None, :].expand(len(lengths), width)
            out, routed = self._recorded(ids, None, pos, cache, keep=0)
        finally:
            hook.remove()
        for layer, own in zip(cache.layers, self.own):
            own.load(layer, rows, group, lengths)
        if self.route is not None and routed is not None:  # past a prompt's end, decode overwrites
            self.route[rows, :width] = routed.view(len(lengths), width, *routed.shape[1:])[group].to(self.route.dtype)
        return out.logits[:, -1]

    def _prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                 group: torch.Tensor) -> torch.Tensor:
        """transformers' static layers: prompts left-padded, then each one's cached positions
        copied into its rows."""
        plens = lengths.tolist()
        width = max(plens)
        dev = ids.device
        shift = torch.arange(width, device=dev)[None, :] - (width - lengths)[:, None]  # [G, width]
        real = shift >= 0
        left = torch.where(real, ids.gather(1, shift.clamp(min=0)), 0)
        padded = min(plens) != width
        out, routed = self._recorded(left, real.long() if padded else None, shift.clamp(min=0))
        grown = getattr(out, self._cache_kw)
        picks: dict[int, tuple] = {}

        def pick(tail: int) -> tuple:
            """(row, prompt, cache index, slot position) of each real token among a cache's last
            ``tail`` padded positions: index ``t`` is slot position ``t - tail + plen``."""
            if tail not in picks:
                t = torch.arange(tail, device=dev)[None, :].expand(len(group), tail)
                slot = t - tail + lengths[group][:, None]
                keep = slot >= 0
                r = torch.arange(len(group), device=dev)[:, None].expand_as(slot)[keep]
                picks[tail] = (rows[r], group[r], t[keep], slot[keep])
            return picks[tail]

        for layer, held in zip(grown.layers, self.held):
            for name in _ATTENTION:
                if name in held:
                    src = getattr(layer, name)
                    if name == "indexer_keys":  # [B, positions, dim]
                        row, g, t, slot = pick(src.shape[1])
                        held[name][row, slot] = src[g, t]
                    else:  # [B, heads, positions, dim]
                        row, g, t, slot = pick(src.shape[2])
                        held[name][row, :, slot] = src[g, :, t]
            if "conv" in held:
                held["conv"][rows] = layer.conv_states[0][group]
                held["recurrent"][rows] = layer.recurrent_states[0][group]
        if self.route is not None and routed is not None:
            row, g, t, slot = pick(width)
            self.route[row, slot] = routed.view(len(plens), width, *routed.shape[1:])[g, t].to(self.route.dtype)
        return out.logits[:, -1]

    def _masks(self, pos: torch.Tensor, length: int) -> Any:
        """The step's 4-D masks ``[B, 1, 1, length]``: a tensor, or one per layer kind."""
        j = self._positions[:length][None, :]
        seen = j <= pos[:, None]
        masks: dict[str, Any] = {}
        if self.own:  # one window for all (DeepSeek-V4's layers all read a sliding window)
            window = self.own[0].window
            masks["own"] = seen & (j > pos[:, None] - window) if window else seen
        for kind in set(self.kinds):
            if kind in ("linear_attention", "conv"):
                masks[kind] = None
            elif kind == "sliding_attention":
                masks[kind] = seen & (j > pos[:, None] - self.window)
            else:
                masks[kind] = seen
        for kind, m in masks.items():
            if m is not None:
                m = m[:, None, None, :]
                masks[kind] = torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill_(
                    ~m, torch.finfo(self.dtype).min) if self.eager else m
        if set(masks) <= {"full_attention", "indexed_attention", "own"}:  # one kind: models that take no mapping
            return next(iter(masks.values()))
        return masks

    @torch.inference_mode()
    def decode(self, tok: torch.Tensor, pos: torch.Tensor, length: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, V]`` of token ``tok[r]`` at position ``pos[r]`` of row ``r``; positions up
        to ``length`` are attended (masked per row)."""
        b = tok.shape[0]
        self.step.pos, self.step.length = pos, length
        for layer in self.linear:
            layer.rows(b)
        res, routed = self._recorded(tok[:, None], self._masks(pos, length), pos[:, None], self.cache)
        if self.route is not None and routed is not None:
            self.route[torch.arange(b, device=pos.device), pos] = routed.to(self.route.dtype)
        logits = res.logits[:, -1]
        if out is None:
            return logits
        out.copy_(logits)
        return out

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Rows ``src`` into rows ``dst``, their first ``length`` positions."""
        for held in self.held:
            for name, t in held.items():
                if name == "indexer_keys":
                    t[dst, :length] = t[src, :length]
                elif name in _ATTENTION:
                    t[dst, :, :length] = t[src, :, :length]
                else:
                    t[dst] = t[src]
        for own in self.own:
            own.move(dst, src, length)
        if self.route is not None:
            self.route[dst, :length] = self.route[src, :length]


def slot_generator(cfg: Any, model: torch.nn.Module, cache_kw: str, recorder: Any = None, arch: Any = None) -> Any:
    """The scheduler over the model's own forward, or None where its cache layers cannot live in
    slots (neither transformers' static layers nor ``arch``'s own, ``OffersSlotLayers``);
    ``recorder`` (routing replay) must follow graph replays (``RecordsGraphReplays``)."""
    from miles.protocols import OffersSlotLayers, RecordsGraphReplays

    own = arch if isinstance(arch, OffersSlotLayers) else None
    kinds = [] if own is not None else slot_kinds(model)
    if kinds is None or (recorder is not None and not isinstance(recorder, RecordsGraphReplays)):
        return None
    return SlotGenerator(cfg, model, HfSlotForward(model, kinds, cache_kw, recorder, own))


class SlotGenerator(FastGenerator):
    """``FastGenerator`` over ``HfSlotForward``: a finished sample also takes its routing rows."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        rec = self.fwd.recorder
        if rec is None:
            return super().generate(*args, **kwargs)
        with rec.recording():
            return super().generate(*args, **kwargs)

    def _with_routes(self, rows: list[int], finish: Callable[[], Any]) -> Any:
        """``finish()`` (which answers ``rows``), then each answer gets its row's experts."""
        route = self.fwd.route
        if route is None or not rows:
            return finish()
        owners = [self.rows.owner[r] for r in rows]
        plens = self.rows.plen[rows].tolist()
        held = route[torch.tensor(rows, device=route.device)].cpu()
        result = finish()
        key = self.fwd.recorder.extension
        for k, (i, j) in enumerate(owners):
            comp = self.out[i][j]
            comp.extras[key] = {"routed_experts": held[k, :plens[k] + max(len(comp.token_ids) - 1, 0)]}
        return result

    def _retire(self, rows: list[int], live: int, t: int) -> int:
        return self._with_routes(rows, lambda: super(SlotGenerator, self)._retire(rows, live, t))

    def _abort(self, queue: Any, live: int, t: int) -> None:
        self._with_routes(list(range(live)), lambda: super(SlotGenerator, self)._abort(queue, live, t))
