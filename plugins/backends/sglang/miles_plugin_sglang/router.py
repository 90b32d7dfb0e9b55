"""Spreads requests over SGLang servers: least outstanding requests, health checks, retries.

Plays the part of SGLang's router (sgl-project/sglang ``sgl-router``, and Miles' own
``miles/router/router.py``: least active requests, background ``/health`` checks, failed workers
left out) inside the engine process, so no extra process is needed. Runs on one asyncio loop.
"""
from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from miles import EngineRestarted, MilesError

PROBE_TIMEOUT_S = 5.0


@dataclass(eq=False)  # identity: a server is found in lists by object
class Server:
    url: str
    outstanding: int = 0  # requests sent and not answered yet
    healthy: bool = True
    weight_version: Any = None  # as the server last reported it
    served: int = 0  # requests it answered (for metrics and tests)
    last_error: str = ""
    stale: bool = field(default=False)  # missed a weight update: kept out until the next one
    restarted: bool = False  # came back after being unreachable: its weights are not ours
    restarts: int = 0  # times that happened (a transport's process group must then be rebuilt)
    inflight: set = field(default_factory=set)  # its requests' tasks, while they are awaited
    abandoned: set = field(default_factory=set)  # those cancelled because the server moved away


class RetryableError(Exception):
    """The request failed on this server and may go to another: the server is unreachable
    (``down``: routed around until a probe finds it again) or answered 5xx (alive: it stays in
    the routing, and a request that keeps failing there ends with the server's message)."""

    def __init__(self, message: str, down: bool):
        super().__init__(message)
        self.down = down


class Router:
    def __init__(self, urls: list[str], *, api_key: str | None, timeout_s: float, max_retries: int,
                 max_concurrency: int, restart_wait_s: float = 0.0, urls_file: str | None = None):
        self.servers = [Server(u) for u in urls]
        self.urls_file = urls_file
        self.restart_wait_s = restart_wait_s
        self.weights_pushed = False  # after the first update, a server that comes back is stale
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=PROBE_TIMEOUT_S),
            limits=httpx.Limits(max_connections=max_concurrency + 2 * len(urls),
                                max_keepalive_connections=max_concurrency))
        self._slots = asyncio.Semaphore(max_concurrency)
        self._turn = 0  # round-robin among equally loaded servers

    # -- choosing a server -----------------------------------------------------------------------
    def pick(self, exclude: set[str]) -> Server | None:
        """The routable server with the fewest outstanding requests (ties: round robin)."""
        n = len(self.servers)
        ok = [(s.outstanding, (i - self._turn) % n, s) for i, s in enumerate(self.servers)
              if s.healthy and not s.stale and s.url not in exclude]
        if not ok:
            return None
        self._turn = (self._turn + 1) % n
        return min(ok, key=lambda t: t[:2])[2]

    # -- requests --------------------------------------------------------------------------------
    async def send(self, server: Server, method: str, path: str, body: Any = None,
                   timeout: float | None = None) -> Any:
        """One request to one server: its JSON answer (or text). ``RetryableError`` when the
        server failed, ``MilesError`` when it rejected the request (4xx)."""
        server.outstanding += 1
        url = server.url
        req = asyncio.ensure_future(self._client.request(method, url + path, json=body, headers=self._headers,
                                                         timeout=timeout or self.timeout_s))
        server.inflight.add(req)
        try:
            r = await req
        except asyncio.CancelledError:
            if req not in server.abandoned:
                raise
            raise RetryableError(f"{url}{path}: the server moved to {server.url}", down=False) from None
        except httpx.TransportError as e:
            raise RetryableError(f"{url}{path}: {type(e).__name__}: {e}", down=True) from e
        finally:
            server.outstanding -= 1
            server.inflight.discard(req)
            server.abandoned.discard(req)
        if r.status_code >= 500:
            raise RetryableError(f"{server.url}{path}: HTTP {r.status_code}: {_message(r)}", down=False)
        if r.status_code == 401:
            raise MilesError(f"{server.url} refused the API key (HTTP 401): set engine.api_key (or "
                             f"the environment variable engine.api_key_env names) to the server's --api-key")
        if r.status_code >= 400:
            raise MilesError(f"{server.url}{path} rejected the request (HTTP {r.status_code}): "
                             f"{_message(r)}")
        server.served += 1
        try:
            return r.json()
        except ValueError:
            return r.text

    async def post(self, path: str, body: Any) -> tuple[Any, Server]:
        """POST to the least loaded healthy server; on failure mark it down and retry on another
        (at most ``max_retries`` times). Returns the answer and the server that gave it. An
        answer from a server that restarted unnoticed is dropped (``_rebooted``) and the request
        goes elsewhere, or ends in ``EngineRestarted`` when no server holds our weights."""
        tried: set[str] = set()
        errors: list[str] = []
        failures = 0
        async with self._slots:
            while failures <= self.max_retries:
                server = self.pick(tried) or await self._revive(set())  # a restarted one may return
                if server is None:
                    break
                tried.add(server.url)
                held = server.weight_version
                try:
                    answer = await self.send(server, "POST", path, body)
                except RetryableError as e:
                    if e.down:
                        self._down(server, str(e))
                    errors.append(str(e))
                    failures += 1
                    continue
                outs = answer if isinstance(answer, list) else [answer]
                versions = [(o.get("meta_info") or {}).get("weight_version", held) for o in outs
                            if isinstance(o, dict) and _generated(o)]
                if not self._rebooted(server, held, versions):
                    return answer, server
        detail = "; ".join(errors) or "no healthy server: " + self.describe()
        raise MilesError(f"{path} failed on every server tried ({len(tried)}): {detail}")

    def _rebooted(self, server: Server, held: Any, versions: list) -> bool:
        """Whether the server reported ``versions`` older than ``held``, its version when the
        request was sent: versions only grow, so it restarted from its model folder unnoticed,
        between two requests. It is then stale like one a probe found back (re-synced by the
        next push)."""
        floor = int_version(held)
        if not self.weights_pushed or floor is None or not server.healthy:
            return False
        if all(n is not None and n >= floor for n in map(int_version, versions)):
            return False
        print(f"miles sglang: {server.url} reported weights older than version {floor}: it restarted",
              file=sys.stderr)
        server.stale = server.restarted = True
        server.restarts += 1
        return True

    async def broadcast(self, method: str, path: str, bodies: list[Any], servers: list[Server],
                        timeout: float | None = None, skip_down: bool = False) -> list[Any]:
        """The same call on each of ``servers`` concurrently (``bodies[i]`` to ``servers[i]``);
        raises ``MilesError`` naming every server that failed, after all have answered.
        ``skip_down``: an unreachable server is marked down and answers None instead."""
        results = await asyncio.gather(*(self.send(s, method, path, b, timeout)
                                         for s, b in zip(servers, bodies)), return_exceptions=True)
        failed = [(s, r) for s, r in zip(servers, results) if isinstance(r, BaseException)]
        down = [s for s, r in failed if isinstance(r, RetryableError) and r.down]
        for s, r in failed:
            if s in down:
                self._down(s, str(r))
        if skip_down:
            failed = [(s, r) for s, r in failed if s not in down]
            results = [None if s in down else r for s, r in zip(servers, results)]
        if failed:
            raise MilesError(f"{path} failed on {len(failed)} of {len(servers)} server(s): "
                             + "; ".join(str(r) for _, r in failed))
        return results

    # -- health ----------------------------------------------------------------------------------
    async def probe(self, server: Server) -> bool:
        """``GET /get_weight_version``: cheap on SGLang (its ``/health`` runs a generation)."""
        if not server.healthy:
            self._follow(server)
        held = server.weight_version
        try:
            r = await self._client.get(server.url + "/get_weight_version", headers=self._headers,
                                       timeout=PROBE_TIMEOUT_S)
            ok = r.status_code == 200
            if ok:
                server.weight_version = r.json().get("weight_version")
                self._rebooted(server, held, [server.weight_version])
            else:
                server.last_error = f"HTTP {r.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            ok, server.last_error = False, f"{type(e).__name__}: {e}"
        if ok and not server.healthy:
            print(f"miles sglang: {server.url} is back", file=sys.stderr)
            if self.weights_pushed:  # a restarted process booted from its model folder
                server.stale = server.restarted = True
                server.restarts += 1
        server.healthy = ok
        return ok

    def _follow(self, server: Server) -> None:
        """A server that is down may have come back elsewhere: take its address from ``urls_file``."""
        if not self.urls_file:
            return
        try:
            urls = json.loads(Path(self.urls_file).read_text())
            url = str(urls[self.servers.index(server)]).rstrip("/")
        except (OSError, ValueError, IndexError, TypeError):
            return  # not written yet, or mid-replace: keep the known address until the next probe
        if url != server.url:
            print(f"miles sglang: {server.url} moved to {url}", file=sys.stderr)
            server.url = url
            for req in list(server.inflight):  # whatever now holds the old address will not answer them
                server.abandoned.add(req)
                req.cancel()

    async def scrape(self, server: Server, path: str, timeout: float) -> str:
        """``GET path`` of one server as text (its ``/metrics``), within ``timeout`` seconds; not a
        routed request (no retries, not counted in its load). ``MilesError`` on an HTTP error."""
        r = await self._client.get(server.url + path, headers=self._headers, timeout=timeout)
        if r.status_code != 200:
            raise MilesError(f"HTTP {r.status_code}")
        return r.text

    async def probe_all(self) -> list[bool]:
        return list(await asyncio.gather(*(self.probe(s) for s in self.servers)))

    async def health_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.probe_all()

    async def _revive(self, exclude: set[str]) -> Server | None:
        """No routable server left: probe the failed ones now instead of waiting for the loop,
        for up to ``restart_wait_s`` (a launcher may be restarting them). A server that comes
        back without our weights raises ``EngineRestarted``: the caller re-syncs and retries."""
        def routable() -> Server | None:
            server = self.pick(exclude)
            back = [s.url for s in self.servers if s.stale and s.healthy]  # restarted, or a push failed
            if server is None and back:
                raise EngineRestarted(f"engine server {', '.join(back)} restarted without the current weights"
                                      if any(s.restarted for s in self.servers) else
                                      f"engine server {', '.join(back)} lacks the current weights (a weight "
                                      f"update failed)")
            return server
        return await self._probe_until(routable, exclude)

    async def await_healthy(self, every: bool) -> None:
        """Before a weight update: wait (up to ``restart_wait_s``, probing) until every server
        (``every``) or at least one answers; a launcher may be restarting the others."""
        await self._probe_until(lambda: (all if every else any)(s.healthy for s in self.servers))

    async def _probe_until(self, done: Any, exclude: set[str] = frozenset()) -> Any:
        """Probe the servers that are down (but ``exclude``) until ``done()`` is truthy or
        ``restart_wait_s`` has passed; ``done()``'s last answer."""
        deadline = asyncio.get_running_loop().time() + self.restart_wait_s
        while True:
            for s in self.servers:
                if not s.healthy and s.url not in exclude:
                    await self.probe(s)
            got = done()
            if got or asyncio.get_running_loop().time() >= deadline:
                return got
            await asyncio.sleep(0.25)

    def _down(self, server: Server, error: str) -> None:
        if server.healthy:
            print(f"miles sglang: {server.url} failed, routing around it: {error}", file=sys.stderr)
        server.healthy, server.last_error = False, error

    def describe(self) -> str:
        return ", ".join(f"{s.url} ({'ok' if s.healthy else s.last_error or 'down'}"
                         f"{', stale weights' if s.stale else ''})" for s in self.servers)

    async def close(self) -> None:
        await self._client.aclose()


def _generated(out: dict) -> bool:
    """Whether a ``/generate`` output holds tokens: one aborted before it ran tells nothing of
    the weights the server holds (and reporting none for it must not read as a restart)."""
    meta = out.get("meta_info") or {}
    return bool(out.get("output_ids") or meta.get("completion_tokens") or meta.get("output_token_logprobs"))


def int_version(v: Any) -> int | None:
    """SGLang reports weight versions as strings ("default" before any update)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _message(r: httpx.Response) -> str:
    """The error text of an SGLang error body (``{"error": {"message"}}`` or ``{"message"}``)."""
    try:
        data = r.json()
    except ValueError:
        return r.text[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:500]
