"""What a run records for ``miles dashboard`` (``miles.protocols.Recorder``), cheaply and bounded:
span timings per step, a few sampled trajectories per step with their per-token rollout and
training log-probs, and device and engine readings from a background thread every few seconds.

Everything happens on trainer rank 0. A span costs two clock reads and a list append; the per-step
work is one timeline line and a handful of sample lines; the recorder times itself and reports it
as the step metric ``telemetry_seconds``.
"""
from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .files import DEVICES, FOLDER, SAMPLES, TIMELINE, RotatingJsonl

MAIN_LANE = "trainer"
MERGE_GAP = 0.002  # back-to-back spans of one name on one lane (a filter per group) read as one


class _Span:
    __slots__ = ("rec", "name", "attrs", "t0")

    def __init__(self, rec: "RunRecorder", name: str, attrs: dict[str, Any]) -> None:
        self.rec, self.name, self.attrs = rec, name, attrs

    def __enter__(self) -> dict[str, Any]:
        self.t0 = time.time()
        return self.attrs

    def __exit__(self, *exc: Any) -> None:
        self.rec.add_span(self.name, self.t0, time.time(), **self.attrs)


def _lane() -> str:
    t = threading.current_thread()
    return MAIN_LANE if t is threading.main_thread() else t.name


def _mean(x: Any) -> float | None:
    if isinstance(x, (int, float)):
        return float(x)
    try:
        vals = [float(v) for v in x]
    except TypeError:
        return None
    return sum(vals) / len(vals) if vals else None


class RunRecorder:
    """``enabled`` False records nothing. ``samples``: trajectories kept per step; ``max_mb``: cap
    of the rotating sample and device files together; ``devices_every``: seconds between readings
    (0: none). Nothing is written before ``open``."""

    def __init__(self, enabled: bool = True, samples: int = 4, max_mb: float = 64.0, devices_every: float = 5.0,
                 seed: int = 0) -> None:
        self.enabled, self.k, self.max_mb, self.every, self.seed = enabled, samples, max_mb, devices_every, seed
        self.on = False
        self._lock = threading.Lock()
        self._spans: list[list[Any]] = []
        self._last: dict[str, int] = {}  # lane -> index of its last span in _spans
        self._picked: dict[int, dict[str, Any]] = {}
        self._cost = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_tokens: dict[str, tuple[float, float]] = {}  # engine -> (time, generated_tokens)
        self.step = 0

    # -- the run's side ----------------------------------------------------------------------------
    def open(self, out_dir: str, tokenizer: Any = None,
             engine_stats: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        """Start recording into ``out_dir/telemetry``; ``tokenizer`` turns sampled token ids into
        text pieces, ``engine_stats()`` gives one reading per engine (running, queued, KV cache...)."""
        if not self.enabled:
            return
        folder = Path(out_dir) / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        cap = int(self.max_mb * 2**20)
        self._timeline = open(folder / TIMELINE, "a")
        self._samples = RotatingJsonl(folder / SAMPLES, cap * 3 // 4)
        self._devices = RotatingJsonl(folder / DEVICES, cap // 4)
        self.tokenizer, self.engine_stats = tokenizer, engine_stats
        self._step_start = time.time()
        self.on = True
        if self.every > 0:
            self._thread = threading.Thread(target=self._read_devices, name="miles-telemetry", daemon=True)
            self._thread.start()

    def span(self, name: str, **attrs: Any) -> contextlib.AbstractContextManager:
        """Times the block as span ``name`` on the calling thread's lane; ``as`` gives its attributes
        (a dict the block may fill in, e.g. ``tokens``)."""
        return _Span(self, name, attrs) if self.on else contextlib.nullcontext({})

    def add_span(self, name: str, t0: float, t1: float, **attrs: Any) -> None:
        if not self.on:
            return
        lane = _lane()
        with self._lock:
            i = self._last.get(lane)
            last = self._spans[i] if i is not None else None
            if last is not None and not attrs and last[0] == name and not last[4] and t0 - last[3] < MERGE_GAP:
                last[3] = t1
                return
            self._last[lane] = len(self._spans)
            self._spans.append([name, lane, t0, t1, attrs])

    def pick(self, step: int, samples: Sequence[Any], advantages: Sequence[Any]) -> None:
        """Keep ``samples`` of this step's training samples (chosen by a seeded draw) for the
        sample browser; their training log-probs come through ``train_logprobs``."""
        if not self.on or not self.k or not samples:
            return
        t = time.perf_counter()
        idx = random.Random(self.seed * 7919 + step).sample(range(len(samples)), min(self.k, len(samples)))
        self._picked = {id(samples[i]): {"index": i, "sample": samples[i], "advantage": _mean(advantages[i])
                                         if i < len(advantages) else None, "train": None} for i in sorted(idx)}
        self._cost += time.perf_counter() - t

    def train_logprobs(self, samples: Sequence[Any], logprobs: Any) -> None:
        """The training log-probs ``[B, R]`` of a (micro-)batch's rows; kept for picked samples
        (the first time each is scored, i.e. before this step's update)."""
        if not self._picked:
            return
        t = time.perf_counter()
        for row, s in enumerate(samples):
            e = self._picked.get(id(s))
            if e is not None and e["train"] is None:
                e["train"] = [round(v, 5) for v in logprobs[row, :len(s.response_ids)].detach().float().cpu().tolist()]
        self._cost += time.perf_counter() - t

    def step_end(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """The step is logged: its spans and picked samples go to disk. Returns the metrics the
        recorder adds (generation throughput, its own cost)."""
        if not self.on:
            return {}
        t, now = time.perf_counter(), time.time()
        with self._lock:
            spans, self._spans, self._last = self._spans, [], {}
        self._timeline.write(_json({"step": step, "start": round(self._step_start, 4), "end": round(now, 4),
                                    "spans": [[n, lane, round(a, 4), round(b, 4), *([x] if x else [])]
                                              for n, lane, a, b, x in spans]}) + "\n")
        self._timeline.flush()
        picked, self._picked = list(self._picked.values()), {}
        for e in picked:
            self._samples.write(self._sample_row(step, e))
        self._step_start, self.step = now, step
        out: dict[str, float] = {}
        gen = [(b - a, x.get("tokens", 0)) for n, _, a, b, x in spans if n == "generate"]
        if gen and sum(d for d, _ in gen) > 0:  # the engine's rate while it generated
            out["rollout_tokens_per_s"] = sum(k for _, k in gen) / sum(d for d, _ in gen)
        self._cost += time.perf_counter() - t
        out["telemetry_seconds"], self._cost = self._cost, 0.0
        return out

    def close(self) -> None:
        if not self.on:
            return
        self.on = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for f in (self._timeline, self._samples, self._devices):
            f.close()

    # -- internals ---------------------------------------------------------------------------------
    def _sample_row(self, step: int, e: dict[str, Any]) -> dict[str, Any]:
        s = e["sample"]
        ids = list(s.response_ids)
        pieces = None
        if self.tokenizer is not None:
            try:
                pieces = self.tokenizer.batch_decode([[i] for i in ids])
            except Exception:  # noqa: BLE001 - a tokenizer without batch_decode: ids only
                pieces = None
        prompt = s.task.prompt if isinstance(s.task.prompt, str) else _json(s.task.prompt)
        status = getattr(s.status, "value", s.status)
        return {"step": step, "index": e["index"], "prompt": prompt, "response": s.response,
                "reward": s.reward, "advantage": e["advantage"], "status": str(status),
                "weight_version": s.weight_version, "label": str(s.task.label)[:500],
                "token_ids": ids, "tokens": pieces,
                "rollout_logprobs": [round(float(v), 5) for v in (s.logprobs or [])],
                "train_logprobs": e["train"], "loss_mask": list(s.loss_mask or [1] * len(ids))}

    def _with_rates(self, engines: Sequence[dict[str, Any]], now: float) -> list[dict[str, Any]]:
        """The readings, each with ``tokens_per_s``: its ``generated_tokens`` since the engine's
        previous fresh reading (by name, else position), over the time between them."""
        out = []
        for i, e in enumerate(engines):
            e = dict(e)
            tokens, key = e.get("generated_tokens"), str(e.get("name", i))
            if isinstance(tokens, (int, float)) and not isinstance(tokens, bool) and not e.get("stale"):
                prev = self._last_tokens.get(key)
                if prev is not None and now > prev[0]:
                    e["tokens_per_s"] = round(max(tokens - prev[1], 0) / (now - prev[0]), 3)
                self._last_tokens[key] = (now, tokens)
            out.append(e)
        return out

    def _read_devices(self) -> None:
        from .devices import DeviceReader

        reader = DeviceReader()
        while not self._stop.is_set():
            t = time.perf_counter()
            row = {"step": self.step, **reader.read()}
            if self.engine_stats is not None:
                try:
                    row["engines"] = self._with_rates(self.engine_stats(), time.time())
                except Exception as e:  # noqa: BLE001 - an engine that cannot answer now is shown as such
                    row["engines_error"] = f"{type(e).__name__}: {e}"[:200]
            self._devices.write(row)
            self._cost += time.perf_counter() - t
            self._stop.wait(self.every)


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, default=str)
