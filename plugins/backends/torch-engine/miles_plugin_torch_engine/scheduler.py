"""The one thread that owns the engine behind ``miles serve``.

The engine is not thread safe, so every engine call (generation, weight updates, cache flushes,
health probes) runs here, one at a time. Generation requests that arrive while the engine is busy
queue up and are run together as one batch: requests are grouped by sampling parameters and
identical prompts are merged, so the samples of one prompt share its prefill (the engine prefills
each distinct prompt once for all of its ``n`` samples).

A batch takes at most ``admit_samples`` samples, shared max-min fairly among the queued requests
(a request asking less than its share gets all it asks); a larger request runs over several
batches. So a small request waits for one batch at most, never behind all of a huge one.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from miles import Completion, SamplingParams
from miles.protocols import Interruptible


@dataclass
class Item:
    """One prompt of a request with its ``n`` samples (``completions`` is filled by the thread)."""

    prompt: tuple[int, ...]
    params: SamplingParams
    n: int
    completions: list[Completion] = field(default_factory=list)


@dataclass(eq=False)  # identity: requests are found in the queue by object
class Request:
    """A ``/generate`` call: its items, answered together through ``future``."""

    rid: str
    items: list[Item]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    seeded: bool = False  # a seeded request is never merged with another one (its draws are its own)
    aborted: str | None = None
    cancelled: bool = False  # its client went away
    unadmitted: list[int] = field(default_factory=list)  # per item: samples not yet in a batch

    @property
    def waiting_samples(self) -> int:
        return sum(self.unadmitted)


def fair_shares(wants: list[int], budget: int) -> list[int]:
    """Max-min fair split of ``budget`` samples: the smallest wants are met in full, the rest
    share what is left equally (one each, smallest first, when there are more wants than samples)."""
    shares = [0] * len(wants)
    order = sorted(range(len(wants)), key=lambda i: wants[i])
    left = budget
    for k, i in enumerate(order):
        if left <= 0:
            break
        shares[i] = min(wants[i], max(left // (len(order) - k), 1))
        left -= shares[i]
    return shares


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any = None,
             error: BaseException | None = None) -> None:
    """Answer an awaiting HTTP handler from this thread (the client may have gone away)."""
    def done():
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:  # the event loop is closed: nobody is waiting any more
        pass


class Scheduler:
    """Runs queued jobs and batched generation on one thread.

    ``submit(request)`` queues a generation request; ``call(fn)`` queues any other engine call and
    returns an awaitable of its result. Jobs run before queued generation, so a weight update
    does not wait behind a backlog; a paused scheduler keeps generation queued but still runs jobs.
    """

    def __init__(self, engine: Any, admit_samples: int | None = None):
        self.engine = engine
        # one engine batch by default: what the engine decodes in one forward
        self.admit_samples = admit_samples or int(getattr(getattr(engine, "cfg", None), "max_batch_size", 1024))
        self._cv = threading.Condition()
        self._pending: list[Request] = []
        self._running: list[Request] = []  # the batch on the engine now
        self._jobs: collections.deque = collections.deque()
        self._paused = False
        self._stopped = False
        stoppable = isinstance(engine, Interruptible)  # the torch engine; a bare speculative generator is not
        self._interrupt = engine.interrupt if stoppable else None
        self._dropped = engine.dropped if stoppable else None
        self._call: list[list[Request]] = []  # the requests behind each prompt of the engine call now
        # num_cancelled: requests whose client went away; cancelled_tokens: tokens the engine
        # generated for them anyway (what a disconnect cost: it stays far below max_new_tokens)
        self.stats = {"num_requests": 0, "num_batches": 0, "num_engine_calls": 0,
                      "num_aborted": 0, "num_running": 0, "num_cancelled": 0, "cancelled_tokens": 0}
        self._thread = threading.Thread(target=self._run, name="miles-engine", daemon=True)
        self._thread.start()

    # -- called from the event loop --------------------------------------------------------------
    def submit(self, request: Request) -> None:
        with self._cv:
            if self._stopped:
                request.aborted = "server is shutting down"
                _resolve(request.loop, request.future, request)
                return
            request.unadmitted = [item.n for item in request.items]
            self._pending.append(request)
            self.stats["num_requests"] += 1
            self._cv.notify()

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """``fn()`` on the engine thread; the returned future (of the running loop) gets its
        result or exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cv:
            if self._stopped:
                future.set_exception(RuntimeError("server is shutting down"))
                return future
            self._jobs.append((fn, loop, future))
            self._cv.notify()
        return future

    def cancel(self, request: Request) -> None:
        """The client of ``request`` went away: drop it if queued; if it runs and every request
        of the running batch is cancelled, cut the batch short (the engine's ``interrupt``); in a
        batch with live requests its prompts leave the engine call (the engine's ``dropped``, when
        no live request shares them), and its sampling-parameter group is skipped if not started."""
        with self._cv:
            if request.cancelled:
                return
            request.cancelled = True
            self.stats["num_cancelled"] += 1
            running = request in self._running  # a request split over batches may be both
            if request in self._pending:
                self._pending.remove(request)
                request.unadmitted = [0] * len(request.unadmitted)
                self.stats["num_aborted"] += 1
                if not running:
                    return
            if (running and self._interrupt is not None
                    and all(r.cancelled for r in self._running)):
                self._interrupt.set()
                self.stats["num_aborted"] += len(self._running)
            elif self._dropped is not None:  # its prompts leave the engine call if no live request shares them
                self._dropped.update(i for i, owners in enumerate(self._call)
                                     if request in owners and all(r.cancelled for r in owners))

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Answer queued requests with ``rid`` (all of them for ``""`` or ``abort_all``) as
        aborted; returns how many. Aborting all also cuts the running batch short (through the
        engine's ``interrupt`` event, if it has one): its unfinished samples answer with
        finish_reason abort and what they generated so far, as SGLang's do. A running request
        aborted by its rid finishes: it shares the engine call with the others of its batch."""
        with self._cv:
            hit = [r for r in self._pending if abort_all or not rid or r.rid == rid]
            self._pending = [r for r in self._pending if r not in hit]
            self.stats["num_aborted"] += len(hit)
            if (abort_all or not rid) and self._interrupt is not None:
                self._interrupt.set()  # cleared when the next batch is taken
        for r in hit:
            r.aborted = "aborted by /abort_request"
            _resolve(r.loop, r.future, r)
        return len(hit)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    @property
    def waiting_samples(self) -> int:
        """Samples of queued requests not yet in a batch; read without the lock (a gauge: a
        reading taken while a batch is admitted may miss it)."""
        return sum(r.waiting_samples for r in list(self._pending))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def stop(self) -> None:
        """Stop taking work; queued requests are answered as aborted, queued jobs fail."""
        with self._cv:
            self._stopped = True
            pending, self._pending = self._pending, []
            jobs, self._jobs = list(self._jobs), collections.deque()
            self._cv.notify()
        for r in pending:
            r.aborted = "server is shutting down"
            _resolve(r.loop, r.future, r)
        for _, loop, future in jobs:
            _resolve(loop, future, error=RuntimeError("server is shutting down"))

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._jobs or (self._pending and not self._paused)):
                    self._cv.wait()
                if self._stopped:
                    return
                job = self._jobs.popleft() if self._jobs else None
                batch: list[tuple[Item, Item, Request]] = []
                if job is None:
                    batch = self._admit()
                    self._running = list({id(r): r for _, _, r in batch}.values())
                    if self._interrupt is not None:
                        self._interrupt.clear()
                    self.stats["num_running"] = len(self._running)
            if job is not None:
                fn, loop, future = job
                try:
                    _resolve(loop, future, fn())
                except BaseException as e:  # noqa: BLE001 - handed to the waiting handler
                    _resolve(loop, future, error=e)
            else:
                try:
                    self._run_batch(batch)
                finally:
                    with self._cv:
                        self._running = []

    def _admit(self) -> list[tuple[Item, Item, Request]]:
        """The next batch as (piece, item, request): fair shares of ``admit_samples`` (see the
        module docstring); a seeded request is admitted whole, as splitting would change its
        draws. Requests with samples left stay queued, in their place. Called under the lock."""
        wants = [r.waiting_samples for r in self._pending]
        shares = fair_shares(wants, self.admit_samples)
        batch = []
        for r, share in zip(self._pending, shares):
            if r.seeded and share:
                share = r.waiting_samples
            for i, item in enumerate(r.items):
                k = min(r.unadmitted[i], share)
                if k <= 0:
                    continue
                r.unadmitted[i] -= k
                share -= k
                whole = k == item.n
                batch.append((item if whole else Item(item.prompt, item.params, k), item, r))
        self._pending = [r for r in self._pending if r.waiting_samples]
        return batch

    def _run_batch(self, pieces: list[tuple[Item, Item, Request]]) -> None:
        self.stats["num_batches"] += 1
        batch = list({id(r): r for _, _, r in pieces}.values())
        failed: dict[int, BaseException] = {}
        for params, items in self._by_params(pieces):
            # requests whose client left while an earlier group ran: no engine call for them
            items = [(item, owner) for item, owner in items if not owner.cancelled]
            if not items:
                continue
            try:
                self._generate(params, items)
            except Exception as e:  # noqa: BLE001 - one bad group must not fail the others
                for _item, owner in items:
                    failed[id(owner)] = e
        self.stats["num_running"] = 0
        for piece, item, r in pieces:
            if piece is not item:
                item.completions.extend(piece.completions)
            if r.cancelled:  # what a disconnect cost
                self.stats["cancelled_tokens"] += sum(len(c.token_ids) for c in piece.completions)
        for r in batch:
            if id(r) in failed:
                with self._cv:
                    if r in self._pending:  # its other samples will not be needed
                        self._pending.remove(r)
                _resolve(r.loop, r.future, error=failed[id(r)])
            elif not r.waiting_samples:
                _resolve(r.loop, r.future, r)

    @staticmethod
    def _by_params(pieces: list[tuple[Item, Item, Request]]):
        """(params, [(piece, request)]) per distinct sampling setting; seeded requests alone."""
        groups: dict[Any, tuple[SamplingParams, list]] = {}
        for piece, _item, r in pieces:
            p = piece.params
            key = (id(r) if r.seeded else None, p.temperature, p.top_p, p.top_k,
                   p.max_new_tokens, tuple(p.stop_token_ids), p.seed)
            groups.setdefault(key, (p, []))[1].append((piece, r))
        return list(groups.values())

    def _generate(self, params: SamplingParams, items: list[tuple[Item, Request]]) -> None:
        """One engine call for the group. Identical prompts are merged so their samples share one
        prefill; ``engine.generate`` takes one ``n`` for all its prompts, so a prompt that wants
        ``k`` samples is passed ``k / g`` times with ``n = g``, ``g`` the gcd of all the ``k``."""
        wanted: dict[tuple[int, ...], list[Item]] = {}
        requests: dict[tuple[int, ...], list[Request]] = {}
        for item, owner in items:
            wanted.setdefault(item.prompt, []).append(item)
            requests.setdefault(item.prompt, []).append(owner)
        counts = {prompt: sum(o.n for o in owners) for prompt, owners in wanted.items()}
        g = math.gcd(*counts.values())
        prompts = [prompt for prompt, k in counts.items() for _ in range(k // g)]
        self.stats["num_engine_calls"] += 1
        with self._cv:
            self._call = [requests[p] for p in prompts]
            if self._dropped is not None:
                self._dropped.clear()
        try:
            outs = self.engine.generate([list(p) for p in prompts], params, n=g)
        finally:
            with self._cv:
                self._call = []
        samples: dict[tuple[int, ...], list[Completion]] = {}
        for prompt, comps in zip(prompts, outs):
            samples.setdefault(prompt, []).extend(comps)
        for prompt, owners in wanted.items():
            it = iter(samples[prompt])
            for owner in owners:
                owner.completions = list(itertools.islice(it, owner.n))
