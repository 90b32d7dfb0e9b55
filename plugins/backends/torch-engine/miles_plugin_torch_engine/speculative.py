"""Speculative decoding on the fast path (``engine.speculative``).

A step drafts ``k`` tokens per row (``drafts.py``: the draft head on the target's hidden states,
or a small draft model), then the target runs the row's last token and the ``k`` drafts as one
block of ``k + 1`` positions over its KV cache. Rejection sampling (Leviathan et al. 2023, Chen
et al. 2023) accepts draft ``i`` with probability ``min(1, p_i(d) / q_i(d))``; at the first
rejection the row takes a token from ``max(0, p_i - q_i)`` renormalised, and when all ``k`` pass, a
bonus token from ``p_{k+1}``. ``p`` and ``q`` are the sampling distributions after temperature,
top-k and top-p, so every sequence has exactly the target's distribution; at temperature 0 both
are one-hot and the tokens are the target's greedy ones. The log-probs returned are the target's
(``log_softmax(logits / T)`` at the emitted token, as plain sampling returns them).

Rejected positions need no rollback: their keys and values sit past the row's position, where
decode masks them until they are overwritten. Rows keep their own positions (continuous
batching), so a step's block attends with a per-row mask. On CUDA the block runs the decode
step's Triton kernels (each of a row's ``k + 1`` tokens is a query row at its own position) and
the whole step (drafts, block, verification, the rows' bookkeeping) replays from CUDA graphs
(``spec_graphs``), the host reading the rows' flags only every few steps; on CPU it is plain
torch. A generate call of more rows than ``max_batch`` goes to the engine's plain
fast path instead, where the block's extra positions cost more than the steps they save.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from miles_fastpath.ops import rms_norm as _rms

from . import cpu_workers, triton_ops
from .batching import FastGenerator, _Rows
from .cuda_graphs import DecodeRunner
from .fast import LlamaFamilyForward, _lin
from .rejection import acceptance, sampling_probs, verify
from .spec_graphs import SpecGraphs
from .spec_meta import EXTRAS_KEY, spec_counts

log = logging.getLogger(__name__)

# rows above which a step stops paying (a generate call of more rows decodes without drafts),
# measured by `python benchmarks/speculative.py --decode` (CPU) and `... --decode --device cuda`
# (H100, 0.5B shape). CPU: no batch size pays at the quickstart's size, even with a head that
# accepts 3.7 tokens of 4 (0.36x at 1 row, 0.5x at 8: the plain path has its own CPU decoder, the
# drafted step ~100 small ops), nor the mtp draft (0.77x at 1 row): auto never drafts there. CUDA,
# the step in graphs: a step costs 1.6x a plain graphed step in GPU time at 1 row and more above,
# so it pays up to about 8 rows where the draft accepts 2-3 tokens a step (an EAGLE head on real
# text); the benchmark's random-weight model's head (1.5-1.6) gives 0.93x at 1 row. Without
# graphs a step cost ~10x a plain one at every batch: auto is off then.
AUTO_MAX_BATCH = {"cpu": 0, "cuda": 8}


class AcceptanceGate:
    """Whether the next call within ``max_batch`` drafts: while the acceptance length of recent
    drafted calls (a running mean) is below ``floor``, calls decode plain, except every
    ``probe_every``-th, which drafts to measure again (a draft trained online gets better)."""

    AUTO = {"cuda": 2.0}  # measured on an H100: a drafted step at 1-8 rows costs 1.75-2.5 plain ones

    def __init__(self, floor: float | None, k: int, probe_every: int = 8):
        self.floor, self.k, self.probe_every = floor, k, probe_every
        self.accept_len: float | None = None
        self._skipped = 0

    @classmethod
    def for_config(cls, spec_cfg: Any, device: torch.device) -> "AcceptanceGate":
        floor = spec_cfg.min_accept_len
        if floor == "auto":  # an explicit max_batch forces drafting up to it
            floor = cls.AUTO.get(device.type) if spec_cfg.max_batch == "auto" else None
        return cls(floor, spec_cfg.tokens)

    def allows(self) -> bool:
        if self.floor is None or self.accept_len is None or self.accept_len >= self.floor:
            return True
        self._skipped += 1
        if self._skipped < self.probe_every:
            return False
        self._skipped = 0
        return True

    def record(self, accept_rate: float | None) -> None:
        """A drafted call's ``accept_rate`` (drafts accepted / drafted)."""
        if accept_rate is None:
            return
        length = 1.0 + self.k * accept_rate
        self.accept_len = length if self.accept_len is None else (self.accept_len + length) / 2


def auto_max_batch(device: torch.device, cuda_graphs: bool) -> int:
    """``engine.speculative.max_batch: auto`` on ``device``: 0 (never) on CPU and on CUDA
    without graphs, said once per engine."""
    limit = 0 if device.type == "cuda" and not cuda_graphs else AUTO_MAX_BATCH.get(device.type, AUTO_MAX_BATCH["cuda"])
    if limit == 0:
        log.warning("engine.speculative: max_batch auto drafts at no batch size on %s%s, where a drafted step "
                    "costs more than the tokens it saves; set engine.speculative.max_batch to draft anyway",
                    device.type, "" if device.type == "cpu" else " without CUDA graphs")
    return limit


def forward_block(fwd: LlamaFamilyForward, tok: torch.Tensor, pos: torch.Tensor | None,
                  rows: torch.Tensor | None = None, repeats: torch.Tensor | None = None,
                  length: int | None = None) -> torch.Tensor:
    """Final (normed) hidden states ``[B, T, d]`` of ``tok [B, T]``.

    Continuation (``pos [B]``): row ``b`` of the packed live rows ``[0, B)`` feeds its tokens at
    positions ``pos[b] ..``, writing their keys/values into its cache row and attending to its
    cache up to each token's own position (positions below ``length``, which defaults to the
    largest fed plus one: a host sync, so a CUDA graph passes its bucket). Prompts (``pos``
    None): right-padded from position 0, attention within the block, keys/values into
    ``repeats[i]`` rows of ``rows`` for prompt ``i``.
    """
    if pos is not None and fwd.use_triton:
        return _forward_block_fused(fwd, tok, pos)
    B, T = tok.shape
    h = fwd.inner.embed_tokens(tok)
    if pos is None:
        cos, sin = fwd.cos[:T], fwd.sin[:T]
    else:
        at = pos[:, None] + torch.arange(T, device=tok.device)  # [B, T]
        cos, sin = fwd.cos[at][:, None], fwd.sin[at][:, None]
        length = int(at.max()) + 1 if length is None else length
        mask = (torch.arange(length, device=tok.device) <= at[..., None])[:, None]  # [B, 1, T, length]
        slots = torch.arange(B, device=tok.device)[:, None]
    for li, layer in enumerate(fwd.inner.layers):
        q, k, v = fwd._qkv(li, _rms(h, layer.input_layernorm), cos, sin, heads_dim=1)
        if pos is None:
            o = fwd._prefill_attention(li, q, k, v, rows, repeats)
        else:
            fwd.k_cache[li][slots, :, at] = k.transpose(1, 2)
            fwd.v_cache[li][slots, :, at] = v.transpose(1, 2)
            o = F.scaled_dot_product_attention(q, fwd.k_cache[li, :B, :, :length], fwd.v_cache[li, :B, :, :length],
                                               attn_mask=mask, scale=fwd.scale,
                                               enable_gqa=fwd.kv_heads != fwd.heads)
        h = h + _lin(o.transpose(1, 2).reshape(B, T, -1), layer.self_attn.o_proj)
        h = fwd._mlp(li, h)
    return _rms(h, fwd.inner.norm)


def _forward_block_fused(fwd: LlamaFamilyForward, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``forward_block`` of a continuation with the decode step's Triton kernels: the ``B * T``
    tokens are query rows, token ``(b, t)`` at position ``pos[b] + t`` of cache row ``b`` (RoPE and
    the cache write, then attention over the row's positions up to its own): about ten kernels a
    layer, no mask, no host sync."""
    B, T = tok.shape
    H, KV, D = fwd.heads, fwd.kv_heads, fwd.head_dim
    layers = fwd.inner.layers
    at = (pos[:, None] + torch.arange(T, device=tok.device)).view(-1)
    h = fwd.inner.embed_tokens(tok).view(B * T, -1)
    x = triton_ops.add_rms_norm(h, None, layers[0].input_layernorm)
    for li in range(len(layers)):
        f = fwd._fused[li]
        qkv = F.linear(x, f["qkv"], f["qkv_bias"]).view(B * T, H + 2 * KV, D)
        q = triton_ops.rope_store(qkv, fwd.cos, fwd.sin, at, fwd.k_cache[li], fwd.v_cache[li], H, KV, per_row=T)
        o = triton_ops.decode_attention(q, fwd.k_cache[li], fwd.v_cache[li], at, fwd.scale, per_row=T)
        x = fwd._fused_rest(li, h, o.view(B * T, -1))
    return x.view(B, T, -1)


def lm_logits(fwd: LlamaFamilyForward, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, fwd.model.lm_head.weight)


class SpecGenerator(FastGenerator):
    """``FastGenerator``'s scheduler (continuous batching, drops, aborts) with speculative steps:
    a row advances by 1 to ``k + 1`` tokens per step. Shares the plain fast path's forward (its
    weights and KV cache) with it."""

    def __init__(self, cfg: Any, model: torch.nn.Module, fwd: LlamaFamilyForward, drafter: Any):
        super().__init__(cfg, model)
        self.fwd = fwd
        self.runner = DecodeRunner(fwd, False)  # its tok / pos buffers: the rows' last token and position
        self.graphs = SpecGraphs(fwd.device, cfg.cuda_graphs, self._state)
        self.prefill = self._prefill
        # on CUDA the host reads the rows' flags every few steps, not every step: a step never
        # waits for the one before it (a finished row emits nothing until it is retired)
        self.sync_every = 4 if fwd.device.type == "cuda" else 1
        self._hi = 0  # host-side bound on the live rows' largest position (no device read)
        self.k, self.drafter = cfg.speculative.tokens, drafter
        limit = cfg.speculative.max_batch
        self.max_batch = auto_max_batch(fwd.device, cfg.cuda_graphs) if limit == "auto" else limit
        # the step reads cache positions below a length bucket unless every forward is Triton's
        self._bucketed = drafter.reads_length or not fwd.use_triton
        # device buffers the graphed step reads and writes in place, kept across generate calls:
        # row-steps, tokens emitted and drafts accepted (drained by the engine); per cache row the
        # verify steps that emitted and the drafts accepted since it joined ([2, slots]); the rows'
        # tokens, log-probs, counts and flags (``_Rows``); the token budget; the stop ids (-1 padded)
        dev = fwd.device
        self.counts = torch.zeros(3, dtype=torch.long, device=dev)
        self._drains = 0
        self.row_counts = torch.zeros((2, 0), dtype=torch.long, device=dev)
        self._rows: tuple = ()
        self._budget = torch.zeros((), dtype=torch.long, device=dev)
        self._stops = torch.full((8,), -1, dtype=torch.long, device=dev)
        self.accept_rate: float | None = None  # drafts accepted / drafted in the last generate call

    def generate(self, *args: Any, **kwargs: Any) -> list:
        """``FastGenerator.generate``; on CPU on a driver thread of one intra-op thread (as the
        plain CPU path's driver, ``cpu_workers``): the caller's OpenMP team stalls at every small
        op whenever another process takes a core."""
        before, drains = self.counts.clone(), self._drains
        if self.fwd.device.type != "cpu" or torch.get_num_threads() <= 1:
            out = super().generate(*args, **kwargs)
        else:
            def drive() -> list:
                with torch.inference_mode():
                    return FastGenerator.generate(self, *args, **kwargs)

            out = cpu_workers.pool(1, "driver").submit(drive).result()
        steps, _, accepted = (self.counts - before).tolist()  # the outputs are on the host: no wait
        if steps and drains == self._drains:  # not drained meanwhile
            self.accept_rate = accepted / (steps * self.k)
        return out

    def _size_cache(self, prompts, steps: int, n: int) -> None:
        super()._size_cache(prompts, steps + self.k + 1, n)  # a block writes k past the last token
        f, dev, width = self.fwd, self.fwd.device, steps + self.k + 1  # a block's tokens past any count
        if self.row_counts.shape[1] != f.slots:
            self.row_counts = torch.zeros((2, f.slots), dtype=torch.long, device=dev)
        if not self._rows or self._rows[0].shape[0] != f.slots or self._rows[0].shape[1] < width:
            self._rows = _Rows(f.slots, width, dev).device_buffers()
        self._hi = 0
        self.drafter.allocate(f)
        self._prepare_graphs()

    def _prepare_graphs(self) -> None:
        """Graphs captured over other buffers than these are dropped."""
        f, run = self.fwd, self.runner
        self.graphs.prepare((f.weights_signature(), f.slots, f.max_len, f.k_cache.data_ptr(), run.tok.data_ptr(),
                             run.pos.data_ptr(), self.drafter.signature(), self._rows[0].data_ptr(),
                             self.row_counts.data_ptr(), self._stops.data_ptr()), f.slots, 2 * self.k + 1)

    def _state(self) -> tuple[torch.Tensor, ...]:
        """What a step advances in place, besides cache positions it rewrites before reading."""
        return (*self.rows.device_buffers(), self.runner.tok, self.runner.pos, self.counts, self.row_counts,
                *self.drafter.state())

    def _new_rows(self, slots: int, steps: int, device: torch.device) -> _Rows:
        """The kept row buffers, every row free: a free row counts as finished, so the graph's
        scratch rows (past the live ones) emit nothing and keep their position 0."""
        stop = self.stop.tolist()
        if len(stop) > self._stops.shape[0]:
            self._stops = torch.full((len(stop),), -1, dtype=torch.long, device=device)
            self._prepare_graphs()
        self._stops.fill_(-1)
        self._stops[:len(stop)] = self.stop
        self._budget.fill_(steps)
        rows = _Rows(slots, steps, device, self._rows)
        rows.count.zero_()
        rows.length.zero_()
        rows.done.fill_(True)
        self.row_counts.zero_()
        return rows

    def _refresh(self) -> None:
        self.fwd.refresh()
        self.runner.prepare()

    def _need(self, live: int, t: int) -> int:
        """One more than the largest position a step from here writes, from the host-side bound
        (a row gains at most ``k + 1`` positions a step and ``max_new_tokens`` in all)."""
        cap = int((self.rows.plen[:live] + self.steps).max()) if live else 0
        return min(self.fwd.max_len, min(self._hi, cap) + self.k + 1)

    def _admit(self, queue: Any, prompts: Any, live: int, t: int) -> int:
        joined = super()._admit(queue, prompts, live, t)
        if joined > live:  # new rows sit at their prompt's length
            self._hi = max(self._hi, int(self.rows.plen[live:joined].max()))
        return joined

    def _prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                 repeats: torch.Tensor) -> torch.Tensor:
        hidden = forward_block(self.fwd, ids, None, rows, repeats)
        at = torch.arange(ids.shape[0], device=ids.device)
        last = hidden[at, lengths - 1]
        self.drafter.join(rows, last.repeat_interleave(repeats, dim=0),
                          ids[at, lengths - 1].repeat_interleave(repeats), ids, lengths, repeats, hidden)
        return lm_logits(self.fwd, last)

    def _retire_finished(self, live: int, t: int, check_done: bool) -> int:
        """Every ``sync_every`` steps (or when rows joined): one read of the rows' finished flags
        and positions, which also tightens ``_hi``."""
        if not check_done or not live:
            return live
        r = self.rows
        flags, pos = torch.stack([(r.done[:live] | (r.count[:live] >= self.steps)).long(),
                                  self.runner.pos[:live]]).tolist()
        out = [row for row, f in enumerate(flags) if f]
        self._hi = max(p for row, p in enumerate(pos) if not flags[row]) if len(out) < live else 0
        return self._retire(out, live, t) if out else live

    def _retire(self, rows: list[int], live: int, t: int) -> int:
        counts = self._row_counts(rows, t)
        left, gone = live - len(rows), set(rows)
        holes = [x for x in rows if x < left]
        if holes:
            movers = [x for x in range(left, live) if x not in gone]
            dev = self.fwd.device
            dst, src = torch.tensor(holes, device=dev), torch.tensor(movers, device=dev)
            self.drafter.move(dst, src, self._need(live, t))
            self.row_counts[:, dst] = self.row_counts[:, src]
        left = super()._retire(rows, live, t)
        self.row_counts[:, left:live] = 0  # free rows: the next ones to join start from zero
        self.rows.done[left:live] = True  # and count as finished (``_new_rows``)
        self._attach_counts(counts)
        return left

    def _abort(self, queue: Any, live: int, t: int) -> None:
        counts = self._row_counts(list(range(live)), t)
        super()._abort(queue, live, t)
        self._attach_counts(counts)

    def _row_counts(self, rows: list[int], t: int) -> list[tuple[tuple[int, int], dict[str, int]]]:
        """(owner, ``spec_counts``) of cache rows ``rows`` leaving before decode step ``t``: the
        verify steps that emitted for the row (not those after it finished) and its drafts accepted."""
        if not rows:
            return []
        idx = torch.tensor(rows, device=self.fwd.device)
        steps, accepted = self.row_counts[:, idx].tolist()
        return [(self.rows.owner[row], spec_counts(s, a, self.k)) for row, s, a in zip(rows, steps, accepted)]

    def _attach_counts(self, counts: list[tuple[tuple[int, int], dict[str, int]]]) -> None:
        for (i, j), c in counts:
            self.out[i][j].extras[EXTRAS_KEY] = c

    def _advance(self, size: int, length: int | None, u: torch.Tensor | None) -> None:
        """One speculative step of rows ``[0, size)``, all on the device: drafts, the verify block,
        rejection sampling, and the rows' tokens, log-probs, counts, flags, positions and the
        draft's state advanced in place. ``length`` / ``u``: the attention length bucket and the
        uniforms of a CUDA graph (None: eager, the length read from the positions and the uniforms
        drawn from the generator). Finished and free rows emit nothing."""
        r, run, k, params, gen = self.rows, self.runner, self.k, self.params, self.gen
        last, pos = run.tok[:size], run.pos[:size]
        drafts, q = self.drafter.propose(size, last, pos, k, params, gen, u=None if u is None else u[:, :k],
                                         length=length)
        hidden = forward_block(self.fwd, torch.cat([last[:, None], drafts], dim=1), pos, length=length)
        logits = lm_logits(self.fwd, hidden).float()
        p = logits if q is None else sampling_probs(logits, params)
        tokens, accepted = verify(p, q, drafts, gen, None if u is None else u[:, k:])
        temp = params.temperature if params.temperature > 0 else 1.0
        logps = torch.log_softmax(logits / temp, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        # emitted: up to the first rejection, the first stop token and the row's token budget (a
        # prefix of the block; the whole block is written, past the row's count)
        j = torch.arange(k + 1, device=tokens.device)
        keep = (j <= accepted[:, None]) & ~r.done[:size, None]
        hit = keep & (tokens[..., None] == self._stops).any(-1)  # a compare, not isin: nothing a graph can't hold
        first_stop = torch.where(hit.any(1), hit.float().argmax(1), k + 1)
        keep &= (j <= first_stop[:, None]) & (j < (self._budget - r.count[:size])[:, None])
        n = keep.sum(1)
        at = torch.arange(size, device=tokens.device)
        cols = r.count[:size, None] + j
        r.tokens[:size].scatter_(1, cols, tokens)
        r.logps[:size].scatter_(1, cols, logps)
        r.length[:size] += n
        r.count[:size] += n
        r.done[:size] |= first_stop < n
        prev = torch.where(n > 1, tokens[at, (n - 2).clamp(min=0)], last)
        emitted = n > 0  # the row was still going
        run.tok[:size] = torch.where(emitted, tokens[at, (n - 1).clamp(min=0)], last)
        self.drafter.commit(size, hidden, tokens, n, pos, prev)
        run.pos[:size] += n
        accepted = accepted * emitted
        self.counts += torch.stack([emitted.sum(), n.sum(), accepted.sum()])
        self.row_counts[:, :size] += torch.stack([emitted.long(), accepted])

    def _decode(self, live: int, t: int) -> None:
        if self.graphs.use_graphs:
            need = self._need(live, t)
            length = min(self.fwd.max_len, -(-need // DecodeRunner.LENGTH_STEP) * DecodeRunner.LENGTH_STEP)
            params = self.params
            mode = ("greedy",) if params.temperature <= 0 else (params.temperature, params.top_k, params.top_p)
            self.graphs.step(self._advance, live, length if self._bucketed else 0, length, mode, self.gen)
        else:
            self._advance(live, None, None)
        self._hi += self.k + 1

    def drain(self) -> dict[str, float]:
        """``spec_accept_len`` and ``spec_accept_rate`` since the last call (``rejection.acceptance``)."""
        taken = self.counts.clone()
        self.counts -= taken  # in stream order with the steps that add to it
        self._drains += 1
        return acceptance(dict(zip(("steps", "emitted", "accepted"), taken.tolist())), self.k)


def setup(cfg: Any, model: torch.nn.Module, fast: Any) -> SpecGenerator:
    """The speculative generator of ``engine.speculative`` over the plain fast path ``fast``,
    its draft made (a head is attached to ``model`` before the engine lists its weights)."""
    from miles import ConfigError

    from .drafts import make_drafter

    if fast is None:
        raise ConfigError(["engine.speculative runs on the fast path (Llama, Qwen2, Qwen3, Mistral in float32 on "
                           "CPU or on CUDA, engine.impl auto or fast, weights_dtype model); this engine runs the "
                           "model's own forward: remove engine.speculative"])
    drafter = make_drafter(cfg.speculative, model, cfg)
    return SpecGenerator(cfg, model, fast.fwd, drafter)

