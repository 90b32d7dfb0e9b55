"""The fast path's scheduler: continuous batching over the preallocated KV cache.

Requests are groups (a prompt and its ``n`` samples; ``n`` above the slot count is split). Waiting
groups join between decode steps as soon as their rows fit: each is prefilled once, its keys and
values copied into one cache row per sample. A row leaves when it has ``max_new_tokens`` tokens or
has sampled a stop token; the last live rows then move into the holes so that live rows stay
packed in ``[0, B)`` (the decode step works on plain slices, see ``cuda_graphs``). Sampling,
stop checks and the per-token log-probs all stay on the device; the host reads the ``done`` flags
only every ``sync_every`` (16) steps on GPU (a stopped row decodes a few wasted steps, but the GPU never
waits for Python), every step on CPU.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from miles import Completion, ConfigError, SamplingParams

from .cuda_graphs import DecodeRunner
from .fast import LlamaFamilyForward, RowsForward, unsupported_reason
from .sampling import sample


def select_fast_path(cfg: Any, model: torch.nn.Module, device: torch.device) -> FastGenerator | None:
    """The fast generator the config asks for, or None for the generic HF path."""
    if cfg.impl == "hf":
        return None
    reason = unsupported_reason(model)
    if reason is not None:
        if cfg.impl == "fast":
            raise ConfigError([(f"engine.impl=fast cannot run this model: {reason}; "
                                "set engine.impl=auto or hf to use the model's own forward")])
        return None
    if device.type == "cpu" and model.lm_head.weight.dtype == torch.float32:
        from .cpu_decode import CpuFastGenerator

        return CpuFastGenerator(cfg, model)  # tested against HF's forward at 1e-5, ~2x generate
    if cfg.impl == "auto" and device.type != "cuda":
        return None  # CPU in half precision: HF's own op order, which the trainer matches
    return FastGenerator(cfg, model)


def _round_up(x: int, step: int) -> int:
    return -(-x // step) * step


class _Rows:
    """Per-row state of one ``generate`` call: device buffers indexed by cache row, host mirrors."""

    def __init__(self, slots: int, steps: int, device: torch.device, buffers: tuple | None = None):
        """``buffers``: the five device buffers to reuse (a generator whose CUDA graphs read them)."""
        if buffers is None:
            buffers = (torch.zeros((slots, steps), dtype=torch.long, device=device),
                       torch.zeros((slots, steps), dtype=torch.float32, device=device),
                       *(torch.zeros(slots, dtype=dt, device=device) for dt in (torch.long, torch.long, torch.bool)))
        # tokens and log-probs sampled, tokens sampled, tokens up to the first stop, stopped
        self.tokens, self.logps, self.count, self.length, self.done = buffers
        self.owner = [(0, 0)] * slots          # (prompt index, sample index)
        self.start = np.zeros(slots, np.int64)  # decode step at which the row joined
        self.plen = np.zeros(slots, np.int64)   # prompt length

    def device_buffers(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.logps, self.count, self.length, self.done

    def move(self, dst: list[int], src: list[int]) -> None:
        for d, s in zip(dst, src):
            self.owner[d] = self.owner[s]
        self.start[dst], self.plen[dst] = self.start[src], self.plen[src]


class FastGenerator:
    """``generate`` for Llama-family models: KV cache allocated once, continuous batching, CUDA
    graphs for decode (on GPU), sampling on the device."""

    def __init__(self, cfg: Any, model: torch.nn.Module, forward: RowsForward | None = None):
        """``forward``: what prefills and decodes the rows (default: the built-in Llama-family
        forward; ``hf_slots.HfSlotForward`` runs the model's own)."""
        self.cfg = cfg
        self.fwd = LlamaFamilyForward(model) if forward is None else forward
        self.runner = DecodeRunner(self.fwd, cfg.cuda_graphs)
        self.prefill = self.fwd.prefill  # the CPU generator swaps in its own prefill step
        self.cuda = self.fwd.device.type == "cuda"
        self.sync_every = 16 if self.cuda else 1
        self.stats: dict[str, int] = {}
        # load readings (``load``), plain values this thread sets and another reads without a lock:
        # rows decoding and waiting, the decode step, the cache positions of the live rows at step
        # ``t`` (``_kv_base + live * t``), and tokens sampled so far (each live row one per step,
        # corrected to the rows' real lengths when they retire)
        self.live = self.queued = self.t = self._kv_base = 0
        self.generated_tokens = 0

    def _size_cache(self, prompts: Sequence[Sequence[int]], steps: int, n: int) -> None:
        """KV cache of (at most ``max_batch_size``) rows for this request and its longest sequence;
        it only grows, so the steady state of a training run allocates once."""
        need = max(len(p) for p in prompts) + steps
        limit = self.cfg.max_seq_len
        if limit is not None and need > limit:
            raise ConfigError([(f"engine.max_seq_len={limit} is shorter than the longest prompt plus "
                                f"max_new_tokens ({need}); raise engine.max_seq_len")])
        length = limit or _round_up(need, DecodeRunner.LENGTH_STEP if self.cuda else 16)
        self.fwd.allocate(min(self.cfg.max_batch_size, _round_up(len(prompts) * n, 64)), length)
        self._refresh()

    def _refresh(self) -> None:
        """Engine-owned weight copies from the module's current weights, then graph buffers."""
        self.fwd.refresh()
        self.runner.prepare()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int,
                 gen: torch.Generator, stop_ids: Sequence[int], version: int,
                 interrupt: threading.Event | None = None,
                 dropped: set[int] | None = None) -> list[list[Completion]]:
        """``n`` completions per prompt; once ``interrupt`` is set, before the next decode step,
        unfinished samples end with finish_reason "abort" (and what they have so far). Prompt
        indices put into ``dropped`` (from another thread: their clients left) leave the batch
        before the next decode step, the other rows going on."""
        steps = params.max_new_tokens
        if steps <= 0:
            return [[Completion([], [], "length", version) for _ in range(n)] for _ in prompts]
        self._size_cache(prompts, steps, n)
        self.slots = slots = self.fwd.slots
        dev = self.fwd.device
        self.params, self.gen, self.steps, self.version = params, gen, steps, version
        self.stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)
        self.rows = self._new_rows(slots, steps, dev)
        self.out: list[list[Completion | None]] = [[None] * n for _ in prompts]
        self.stats = dict(prefills=0, prefilled_prompts=0, decode_steps=0, max_rows=0, joined_mid_decode=0)
        queue = deque((i, s, min(slots, n - s)) for i in range(len(prompts)) for s in range(0, n, slots))
        live, t = 0, 0
        self.queued, self.t, self._kv_base = len(prompts) * n, 0, 0
        try:
            while queue or live:
                if interrupt is not None and interrupt.is_set():
                    self._abort(queue, live, t)
                    break
                if dropped:
                    live = self._drop(dropped, queue, live, t)
                check = t % self.sync_every == 0
                while True:  # until nothing leaves and nothing joins: a group can stop at its first token
                    live = self._retire_finished(live, t, check)
                    joined = self._admit(queue, prompts, live, t)
                    if joined == live:
                        break
                    self.generated_tokens += joined - live  # a prefill samples each new row's first token
                    live, check = joined, True
                    self.stats["max_rows"] = max(self.stats["max_rows"], live)
                self.live = live
                if live:
                    self._decode(live, t)
                    t += 1
                    self.t = t
                    self.generated_tokens += live
        finally:
            self.live = self.queued = self._kv_base = 0
        self.stats["decode_steps"] = t
        return self.out  # type: ignore[return-value]

    def _new_rows(self, slots: int, steps: int, device: torch.device) -> _Rows:
        return _Rows(slots, steps, device)

    def load(self) -> tuple[int, int, int, int]:
        """(rows decoding, rows waiting for a cache row, cache positions the live rows hold, cache
        positions allocated), from plain values the generating thread sets: read from any thread
        without a lock or a device sync (a reading taken mid-step may be a step off). Positions
        are one per step since a row joined: exact on the plain path, a lower bound when a
        speculative step advances a row by more."""
        live, t, f = self.live, self.t, self.fwd
        cap = f.slots * f.max_len if f.k_cache is not None else 0
        used = min(max(self._kv_base + live * t, 0), cap) if live else 0
        return live, max(self.queued, 0), used, cap

    def _retire_finished(self, live: int, t: int, check_done: bool) -> int:
        """Retire rows with all their tokens and, when ``check_done`` (or a retirement syncs
        anyway), rows that sampled a stop token."""
        full = np.flatnonzero(self.rows.start[:live] == t - self.steps + 1).tolist()
        if full or check_done:
            done = np.flatnonzero(self.rows.done[:live].cpu().numpy()).tolist()  # one device read
            full = sorted(set(full) | set(done))
        return self._retire(full, live, t) if full else live

    def _drop(self, dropped: set[int], queue: deque, live: int, t: int) -> int:
        """Retire the live rows of the prompts in ``dropped`` with what they have, and take their
        waiting groups out of the queue (answered empty, finish_reason "abort")."""
        gone = set(dropped)
        for i, first, count in [g for g in queue if g[0] in gone]:
            queue.remove((i, first, count))
            self.queued -= count
            for j in range(first, first + count):
                self.out[i][j] = Completion([], [], "abort", self.version)
        rows = [row for row in range(live) if self.rows.owner[row][0] in gone]
        return self._retire(rows, live, t) if rows else live

    def _abort(self, queue: deque, live: int, t: int) -> None:
        """Interrupted: live rows answer with what they have (abort, unless they had finished),
        groups still queued with nothing; the rows are left as retiring them all would."""
        r = self.rows
        tokens, logps, length, done = self._finished(list(range(live)), t) if live else ([],) * 4
        self._counted(list(range(live)), length, t)
        for row in range(live):
            i, j = r.owner[row]
            k = length[row]
            reason = "stop" if done[row] else "length" if k >= self.steps else "abort"
            self.out[i][j] = Completion(tokens[row][:k], logps[row][:k], reason, self.version)
        for i, first, count in queue:
            for j in range(first, first + count):
                self.out[i][j] = Completion([], [], "abort", self.version)
        queue.clear()
        self.runner.scrub(0)

    def _need(self, live: int, t: int) -> int:
        """One more than the largest position fed at decode step ``t``."""
        return int(t + (self.rows.plen[:live] - self.rows.start[:live]).max()) + 1

    def _admit(self, queue: deque, prompts, live: int, t: int) -> int:
        """Prefill waiting groups that fit into free rows (within the prefill token budget)."""
        picked: list[tuple[int, int, int]] = []
        rows, width = live, 0
        while queue and rows + queue[0][2] <= self.slots:
            w = max(width, len(prompts[queue[0][0]]))
            if picked and w * (len(picked) + 1) > self.cfg.prefill_tokens:
                break
            picked.append(queue.popleft())
            rows, width = rows + picked[-1][2], w
        if not picked:
            return live
        dev, r = self.fwd.device, self.rows
        plens = [len(prompts[i]) for i, _, _ in picked]
        ids = torch.tensor([[*prompts[i], *[0] * (width - n)] for (i, _, _), n in zip(picked, plens)],
                           dtype=torch.long)  # right-padded; one call (a tensor per prompt costs ~10 us)
        reps = torch.tensor([c for _, _, c in picked], device=dev)
        new = torch.arange(live, rows, device=dev)
        logits = self.prefill(ids.to(dev), torch.tensor(plens, device=dev), new, reps)
        tok, lp = sample(logits.repeat_interleave(reps, dim=0), self.params, self.gen)
        r.tokens[new, 0], r.logps[new, 0] = tok, lp
        r.count[new], r.length[new] = 1, 1
        r.done[new] = torch.isin(tok, self.stop)
        self.runner.tok[new] = tok
        self.runner.pos[new] = torch.tensor(plens, device=dev).repeat_interleave(reps)
        k = live
        for (i, first, count), plen in zip(picked, plens):
            for j in range(count):
                r.owner[k], r.start[k], r.plen[k] = (i, first + j), t, plen
                k += 1
            self._kv_base += count * (plen - t)
        self.queued -= rows - live
        self.stats["prefills"] += 1
        self.stats["prefilled_prompts"] += len(picked)
        self.stats["joined_mid_decode"] += len(picked) if live > 0 else 0
        return rows

    def _decode(self, live: int, t: int) -> None:
        r = self.rows
        logits = self.runner.step(live, self._need(live, t))
        tok, lp = sample(logits, self.params, self.gen)
        at = torch.arange(live, device=tok.device)
        col = r.count[:live]
        r.tokens[at, col], r.logps[at, col] = tok, lp
        r.length[:live] += ~r.done[:live]
        r.done[:live] |= torch.isin(tok, self.stop)
        r.count[:live] += 1
        self.runner.tok[:live] = tok
        self.runner.pos[:live] += 1

    def _finished(self, rows: list[int], t: int) -> tuple[list, list, list, list]:
        """Tokens, log-probs, lengths and stop flags of cache rows ``rows`` (host lists)."""
        r = self.rows
        idx = torch.tensor(rows, device=self.fwd.device)
        return r.tokens[idx].tolist(), r.logps[idx].tolist(), r.length[idx].tolist(), r.done[idx].tolist()

    def _counted(self, rows: list[int], length: list[int], t: int) -> None:
        """Rows leaving at step ``t`` with ``length`` tokens each: ``generated_tokens`` counted one
        per step since each joined (a GPU row decodes a few steps past its stop token before the
        host sees it, a speculative step adds up to ``k + 1``), now their real lengths; their cache
        positions leave the load reading."""
        r = self.rows
        self.generated_tokens += sum(length) - int((t + 1 - r.start[rows]).sum())
        self._kv_base -= int((r.plen[rows] - r.start[rows]).sum())

    def _retire(self, rows: list[int], live: int, t: int) -> int:
        """Hand back finished rows' completions and pack the live rows into ``[0, live')``."""
        r, dev = self.rows, self.fwd.device
        tokens, logps, length, done = self._finished(rows, t)
        self._counted(rows, length, t)
        for k, row in enumerate(rows):
            i, j = r.owner[row]
            n = length[k]
            self.out[i][j] = Completion(tokens[k][:n], logps[k][:n], "stop" if done[k] else "length",
                                        self.version)
        left = live - len(rows)
        gone = set(rows)
        holes = [x for x in rows if x < left]
        movers = [x for x in range(left, live) if x not in gone]
        if holes:
            need = self._need(live, t)
            dst, src = torch.tensor(holes, device=dev), torch.tensor(movers, device=dev)
            self.fwd.move_rows(dst, src, need)
            for buf in r.device_buffers() + (self.runner.tok, self.runner.pos):
                buf[dst] = buf[src]
            r.move(holes, movers)
        self.runner.scrub(left)
        return left
