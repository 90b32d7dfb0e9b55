"""The ``sglang`` engine: miles' Engine protocol over SGLang's native HTTP API.

Payloads follow SGLang's ``python/sglang/srt/entrypoints/http_server.py`` (routes) and
``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``UpdateWeightsFromTensorReqInput``, ``DestroyWeightsUpdateGroupReqInput``); responses are read as
Miles does (token ids and log-probs from ``meta_info.output_token_logprobs``). The ``sglang``
package itself is never imported: it pins its own torch.

The methods are synchronous (the loop and the transports call them from plain threads); the HTTP
work runs on a private asyncio loop in a daemon thread.
"""
from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
import time
from typing import Any, Iterable, Sequence

from miles import Completion, MilesError, SamplingParams
from miles.protocols import RecordsRouting

from .config import SGLangEngineConfig
from .router import Router, Server, int_version
from .routing import attach, join_routed
from .speculative import Acceptance
from .stats import ServerStats

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


class SGLangEngine:
    """Client of one or more SGLang-compatible servers (``cfg.urls``)."""

    remote = True  # transports must move weights through the update_weights_* methods
    accepts_buckets = False  # set by init_weights_update_group: every server is `miles serve`
    routed_experts = False  # ask /generate for return_routed_experts (an MoE spec with routing replay)

    def __init__(self, cfg: SGLangEngineConfig, *, tokenizer: Any = None, seed: int = 0, spec: Any = None,
                 **_: Any):
        self.cfg = cfg
        # an MoE spec with routing replay: ask the servers for the experts each token went to
        self.routed_experts = isinstance(spec, RecordsRouting)
        self.tokenizer = tokenizer
        self.sampling_params: SamplingParams | None = None
        self.seed = seed
        self.weight_version = 0
        self._pauses = 0  # pause_generation(mode="abort") calls: the outputs they cut short resume
        self._generating = asyncio.Event()  # clear while we hold the servers paused (our loop only)
        self._generating.set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="miles-sglang", daemon=True)
        self._thread.start()
        api_key = cfg.api_key or os.environ.get(cfg.api_key_env) or None
        self.router: Router = self._run(self._make_router(api_key))
        self._stats = ServerStats(self.router, self._loop)
        self._acceptance = Acceptance()  # speculative decoding's, from the outputs' meta_info
        self._health_task = None
        self._weights_dir = cfg.weights_dir
        try:
            self._run(self._wait_ready())
        except BaseException:
            self.close()
            raise
        self._health_task = asyncio.run_coroutine_threadsafe(
            self.router.health_loop(cfg.health_check_interval_s), self._loop)

    # -- plumbing --------------------------------------------------------------------------------
    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _make_router(self, api_key: str | None) -> Router:
        c = self.cfg
        return Router(c.urls, api_key=api_key, timeout_s=c.timeout_s, max_retries=c.max_retries,
                      max_concurrency=c.max_concurrency, restart_wait_s=c.restart_wait_s,
                      urls_file=c.urls_file)

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            ok = await self.router.probe_all()
            if all(ok) or (any(ok) and time.monotonic() >= deadline):
                break
            if time.monotonic() >= deadline:
                raise MilesError(f"no SGLang server answered within {self.cfg.startup_timeout_s:g} s "
                                 f"(engine.startup_timeout_s): {self.router.describe()}")
            await asyncio.sleep(0.5)
        down = [s.url for s in self.router.servers if not s.healthy]
        if down:
            print(f"miles sglang: not answering, left out for now: {', '.join(down)}", file=sys.stderr)
        versions = [int_version(s.weight_version) for s in self.router.servers if s.healthy]
        self.weight_version = max((v for v in versions if v is not None), default=0)

    def close(self) -> None:
        """Stop the health checks and close the HTTP connections (the servers keep running)."""
        if not self._loop.is_running():
            return
        if self._health_task is not None:
            self._health_task.cancel()
        if getattr(self, "router", None) is not None:
            self._run(self.router.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 n: int = 1) -> list[list[Completion]]:
        """``n`` completions per prompt. One ``/generate`` request per prompt carries
        ``sampling_params.n = n``, so the group's samples go to one server together and share
        the prompt's prefix there (SGLang's parallel sampling; the torch server's prefill)."""
        if n < 1:
            raise ValueError("n must be >= 1")
        return self._run(self._generate(prompts, params, n))

    async def _generate(self, prompts, params: SamplingParams, n: int) -> list[list[Completion]]:
        """One batched ``/generate`` request per routable server (a server batches what arrives
        together, but separate requests trickle in and would run as many small batches)."""
        prompts = [list(p) for p in prompts]
        servers = sum(s.healthy and not s.stale for s in self.router.servers) or 1
        k = min(len(prompts), self.cfg.requests_per_call or servers)
        size = -(-len(prompts) // k)
        parts = await asyncio.gather(*(self._batch(prompts[i:i + size], params, n, i)
                                       for i in range(0, len(prompts), size)))
        return [group for part in parts for group in part]

    async def _batch(self, prompts: list[list[int]], params: SamplingParams, n: int,
                     offset: int) -> list[list[Completion]]:
        """``n`` samples of each prompt in one request. SGLang answers a batch with ``n > 1``
        sample-major (all prompts' first samples, then the second ...; ``GenerateReqInput.
        _expand_inputs`` in ``managers/io_struct.py``)."""
        sampling = _sampling(params, n)
        seeds = None
        if params.seed is not None and self.cfg.seeded_requests:  # distinct per prompt, reproducible per call
            seeds = [params.seed + offset + i for i in range(len(prompts))]
            sampling = [{**sampling, "sampling_seed": seed} for seed in seeds]
        outs, pauses = await self._post(prompts, sampling)
        B = len(prompts)
        if len(outs) != B * n:
            raise MilesError(f"/generate answered {len(outs)} outputs for {B} prompts x n={n}")
        groups = [[self._completion(outs[j * B + i]) for j in range(n)] for i in range(B)]
        if pauses != self._pauses:  # our pause_generation(mode="abort") may have cut some short
            # a resumed piece's seed: its prompt's, its sample's index and the round mixed in
            pieces = [(p, c, None if seeds is None else seeds[i] * 1_000_003 + j * 1009)
                      for i, (p, g) in enumerate(zip(prompts, groups)) for j, c in enumerate(g)]
            await self._resume(pieces, params)
        return groups

    async def _post(self, prompts: list[list[int]], sampling: Any) -> tuple[list[dict], int]:
        """``/generate`` once we do not hold the servers paused; its outputs, and the count of
        our aborting pauses it was sent under."""
        while not self._generating.is_set():  # a loop: a new pause may come before we wake
            await self._generating.wait()
        pauses = self._pauses
        body = {"input_ids": prompts, "sampling_params": sampling, "return_logprob": True}
        if self.routed_experts:
            body["return_routed_experts"] = True
        data, _ = await self.router.post("/generate", body)
        outs = data if isinstance(data, list) else [data]
        for out in outs:
            self._acceptance.add(out)
        return outs, pauses

    async def _resume(self, pieces: list[tuple[list[int], Completion, int | None]],
                      params: SamplingParams) -> None:
        """Partial rollout: each completion our pause aborted goes on from prompt + its tokens
        with the tokens it has left, on the weights loaded before generation continued; the
        pieces are joined in place (again, if another pause cuts the rest short). A piece with a
        seed (``seeded_requests``) sends a ``sampling_seed`` of its own in every round."""
        todo = [(p, c, seed) for p, c, seed in pieces if c.finish_reason == "abort"]
        rounds = 0
        while todo:
            rounds += 1
            sampling = []
            for _, c, seed in todo:
                one = {**_sampling(params, 1), "max_new_tokens": max(0, params.max_new_tokens - len(c.token_ids))}
                if seed is not None:
                    one["sampling_seed"] = (seed + rounds) % 2**63
                sampling.append(one)
            outs, pauses = await self._post([p + c.token_ids for p, c, _ in todo], sampling)
            for (_, c, _), out in zip(todo, outs):
                rest = self._completion(out)
                join_routed(c, rest, len(c.token_ids))
                _join(c, rest)
            paused_meanwhile = pauses != self._pauses
            todo = [piece for piece in todo if piece[1].finish_reason == "abort" and paused_meanwhile]

    def _completion(self, out: dict) -> Completion:
        """A ``miles.Completion`` from one SGLang output: token ids and log-probs from
        ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` per token)."""
        meta = out.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs") or []
        ids = [int(p[1]) for p in pairs] if pairs else [int(t) for t in out.get("output_ids") or []]
        finish = (meta.get("finish_reason") or {}).get("type") or "length"
        version = int_version(meta.get("weight_version"))
        version = self.weight_version if version is None else version
        return attach(Completion(ids, [float(p[0]) for p in pairs], finish, version, [version]), meta)

    # -- weights ---------------------------------------------------------------------------------
    @property
    def num_weight_ranks(self) -> int:
        """Ranks this engine takes in a weight-update process group (all its servers')."""
        return sum(self._ranks_per_server())

    @property
    def restarts(self) -> int:
        """Server restarts seen so far: a change means groups they were in are gone."""
        return sum(s.restarts for s in self.router.servers)

    def _ranks_per_server(self) -> list[int]:
        return list(self.cfg.ranks_per_server or [1] * len(self.router.servers))

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Write the tensors as a version of the ``disk`` transport's format into
        ``engine.weights_dir`` and have every server load it (``update_weights_from_disk``); the
        servers must see that folder (same machine or shared disk)."""
        from .disk import write_version

        if self._weights_dir is None:
            self._weights_dir = tempfile.mkdtemp(prefix="miles-sglang-weights-")
        write_version(self._weights_dir, named_tensors, version)
        self.update_weights_from_disk(model_path=self._weights_dir, weight_version=version)

    def update_weights_from_disk(self, model_path: str, weight_version: Any = None, **kw: Any) -> list:
        """``POST /update_weights_from_disk`` on every live server; a server that is down misses
        the update and is kept out of rotation until a later update reaches it."""
        return self._update("/update_weights_from_disk",
                            {"model_path": model_path, "weight_version": weight_version, **kw},
                            weight_version, live_only=True)

    def update_weights_from_tensor(self, serialized_named_tensors: Any, load_format: Any = None,
                                   weight_version: Any = None, **kw: Any) -> list:
        """``POST /update_weights_from_tensor`` (the same payload to every live server)."""
        body = {"serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
                "weight_version": weight_version, **kw}
        return self._update("/update_weights_from_tensor", body, weight_version, live_only=True)

    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int,
                                  rank_offset: int | Sequence[int] | None = None,
                                  group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> list:
        """``POST /init_weights_update_group`` on every server, concurrently (it is collective
        with the trainer, which joins from another thread). ``rank_offset``: a list (one rank per
        server), or the first rank of this engine (default 1: the trainer is rank 0), each server
        then starting where the previous one's ``ranks_per_server`` end."""
        sizes = self._ranks_per_server()
        if rank_offset is None or isinstance(rank_offset, int):
            first = 1 if rank_offset is None else rank_offset
            ranks = [first + sum(sizes[:i]) for i in range(len(sizes))]
        else:
            ranks = [int(r) for r in rank_offset]
        if len(ranks) != len(sizes):
            raise MilesError(f"init_weights_update_group: {len(ranks)} rank offsets for {len(sizes)} servers")
        bodies = [{"master_address": master_address, "master_port": master_port, "rank_offset": r,
                   "world_size": world_size, "group_name": group_name, "backend": backend}
                  for r in ranks]
        self._run(self.router.await_healthy(every=True))  # a restarting server joins once it is back
        out = self._all("/init_weights_update_group", bodies)
        # `miles serve` takes a whole sync's buckets in one update call (SGLang servers: one per bucket)
        info = self._run(self.router.broadcast("GET", "/get_server_info", [None] * len(sizes),
                                               self.router.servers))
        self.accepts_buckets = all(isinstance(i, dict) and i.get("accepts_buckets") is True for i in info)
        return out

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str = DEFAULT_GROUP,
                                        weight_version: Any = None, flush_cache: bool = True,
                                        **kw: Any) -> list:
        """``POST /update_weights_from_distributed`` on every server while the trainer
        broadcasts the bucket (call from a thread of its own)."""
        body = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                "group_name": group_name, "weight_version": weight_version,
                "flush_cache": flush_cache, **kw}
        try:
            out = self._all("/update_weights_from_distributed", [body] * len(self.router.servers))
        except BaseException:  # the servers hold part of this version: none generates before a re-sync
            for s in self.router.servers:
                s.stale = True
            raise
        self.router.weights_pushed = True
        for s in self.router.servers:
            s.stale = s.restarted = False
        self._set_version(weight_version, self.router.servers)
        return out

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> list:
        """``POST /destroy_weights_update_group`` on every server."""
        return self._all("/destroy_weights_update_group",
                         [{"group_name": group_name}] * len(self.router.servers))

    def weight_checksums(self, names: Sequence[str] | None = None) -> dict[str, str] | None:
        """``POST /weights_checksum`` (the torch server's extension) on every live server; the
        servers must agree, and their common checksums are returned. None when no server holds
        the last weights pushed (they went down during the push: nothing to check until then)."""
        live = [s for s in self.router.servers if s.healthy and not s.stale]
        answers = self._run(self.router.broadcast(
            "POST", "/weights_checksum", [{"names": None if names is None else list(names)}] * len(live), live,
            skip_down=True))  # one that goes down now is re-synced once back: nothing to check there
        live = [s for s in live if s.healthy]  # a server that went down answered None
        if not live and self.router.weights_pushed:
            return None
        sums = [a.get("checksums") or {} for a in answers if a is not None]
        for s, other in zip(live[1:], sums[1:]):
            differ = sorted(k for k in set(sums[0]) | set(other) if sums[0].get(k) != other.get(k))
            if differ:
                raise MilesError(f"servers disagree on weights: {live[0].url} and {s.url} differ on "
                                 f"{differ[0]} ({len(differ)} tensor(s))")
        return sums[0] if sums else {}

    def p2p_open(self, tensors: Sequence[dict], transport: str = "tcp") -> list[dict]:
        """``POST /p2p/open`` (the torch server's extension for the ``p2p`` transport) on every
        live server: each one's transfer endpoint (agent, targets, session), with its ``url``."""
        self._run(self.router.await_healthy(every=False))
        live = [s for s in self.router.servers if s.healthy]
        body = {"tensors": list(tensors), "transport": transport}
        answers = self._run(self.router.broadcast("POST", "/p2p/open", [body] * len(live), live, skip_down=True))
        return [{**a, "url": s.url} for s, a in zip(live, answers) if isinstance(a, dict)]

    def p2p_commit(self, weight_version: Any, sessions: Sequence[str]) -> list:
        """``POST /p2p/commit`` on every live server once the trainer's writes are in; a server
        that took no part in them (down meanwhile, restarted) stays out until re-synced."""
        live = [s for s in self.router.servers if s.healthy]
        body = {"weight_version": weight_version, "sessions": list(sessions)}
        answers = self._run(self.router.broadcast("POST", "/p2p/commit", [body] * len(live), live, skip_down=True))
        done = [s for s, a in zip(live, answers) if isinstance(a, dict) and a.get("committed")]
        for s in self.router.servers:
            s.stale = s not in done
            s.restarted = s.restarted and s.stale
        self.router.weights_pushed = True
        self._set_version(weight_version, done)
        return answers

    def _update(self, path: str, body: dict, weight_version: Any, live_only: bool) -> list:
        """``path`` on every server (``live_only``: every live one, waiting for one to be back if
        none is). A server that goes down meanwhile misses the update: it stays out of rotation
        (stale) until it is back and re-synced (``EngineRestarted``), not an error here."""
        if live_only:
            self._run(self.router.await_healthy(every=False))
        servers = [s for s in self.router.servers if s.healthy] if live_only else self.router.servers
        if not servers:
            raise MilesError(f"{path}: no live server: {self.router.describe()}")
        out = self._run(self.router.broadcast("POST", path, [body] * len(servers), servers, skip_down=live_only))
        servers = [s for s in servers if s.healthy or not live_only]  # those that went down missed it
        for s in self.router.servers:
            s.stale = s not in servers
            s.restarted = s.restarted and s.stale
        self.router.weights_pushed = True
        self._set_version(weight_version, servers)
        return out

    def servers_down(self) -> list[str]:
        """The servers that do not answer now (probed): a failed weight push with one of these
        down is the engine's fault, not the transport's; the push is redone once it is back."""
        return [s.url for s, ok in zip(self.router.servers, self._run(self.router.probe_all())) if not ok]

    def _all(self, path: str, bodies: list[dict]) -> list:
        return self._run(self.router.broadcast("POST", path, bodies, self.router.servers))

    def _set_version(self, weight_version: Any, servers: list[Server]) -> None:
        v = int_version(weight_version)
        if v is not None:
            self.weight_version = v
        for s in servers:
            s.weight_version = weight_version

    # -- control ---------------------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> list:
        """``POST /pause_generation`` on every live server (SGLang's ``mode``: "abort", "retract",
        "in_place"). With "abort" the requests in flight answer at once with what they generated
        so far, and ``generate`` resumes them (``rollout.in_flight: resume``) once
        ``continue_generation`` is called: they finish on the weights loaded in between. A
        server found unreachable is routed around, not an error (it has nothing to pause)."""
        if mode == "abort":
            self._run(self._hold())
        return self._control("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> list:
        """``POST /continue_generation`` on every live server; requests held back since an
        aborting pause go out."""
        try:
            return self._control("POST", "/continue_generation")
        finally:
            self._loop.call_soon_threadsafe(self._generating.set)

    async def _hold(self) -> None:
        self._pauses += 1
        self._generating.clear()

    def flush_cache(self) -> list:
        """``POST /flush_cache`` on every live server."""
        return self._control("POST", "/flush_cache")

    def _control(self, method: str, path: str, body: Any = None) -> list:
        live = [s for s in self.router.servers if s.healthy]
        return self._run(self.router.broadcast(method, path, [body] * len(live), live, skip_down=True))

    def health(self) -> dict[str, bool]:
        """Probe every server now: ``{url: healthy}`` (also updates the routing)."""
        ok = self._run(self.router.probe_all())
        return {s.url: h for s, h in zip(self.router.servers, ok)}

    def engine_stats(self) -> list[dict[str, Any]]:
        """Each server's load from its ``GET /metrics`` (``miles.protocols.EngineStats``): running
        and queued sequences, KV cache use, tokens generated, speculative acceptance; waits at
        most ``stats.TIMEOUT_S``, a server that does not answer keeps its last reading (stale)."""
        return self._stats.read()

    def step_metrics(self) -> dict[str, float]:
        """Speculative decoding's ``spec_accept_len`` and ``spec_accept_rate`` over the outputs
        received since the last call (``miles.protocols.EngineStepMetrics``; ``speculative.py``)."""
        return self._acceptance.drain()

    def server_stats(self) -> dict[str, dict]:
        """Per server: requests answered, outstanding, healthy, stale."""
        return {s.url: {"served": s.served, "outstanding": s.outstanding, "healthy": s.healthy,
                        "stale": s.stale} for s in self.router.servers}


def _sampling(params: SamplingParams, n: int) -> dict:
    """SGLang ``sampling_params`` of one request."""
    return {"temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1, "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": list(params.stop_token_ids), "n": n, "no_stop_trim": True,
            "skip_special_tokens": False}


def _join(first: Completion, rest: Completion) -> None:
    """``rest``, generated after ``first`` was aborted, appended to it; a segment without tokens
    leaves no weight version behind; ``weight_version`` becomes the oldest."""
    versions = [v for c in (first, rest) if c.token_ids for v in c.weight_versions]
    first.weight_versions = versions or rest.weight_versions
    first.weight_version = min(first.weight_versions)
    first.token_ids, first.logprobs = first.token_ids + rest.token_ids, first.logprobs + rest.logprobs
    first.finish_reason = rest.finish_reason

