"""The servers' load for ``SGLangEngine.engine_stats`` (``miles.protocols.EngineStats``): each one's
``GET /metrics`` (``miles serve``'s ``miles_engine_*`` names, or SGLang's ``sglang:*`` ones when it
runs with ``--enable-metrics``), read into running and queued sequences, KV cache use, tokens
generated and speculative acceptance (``miles_telemetry.prom.engine_reading``).

The scrapes run on the engine's asyncio loop beside generation (plain GETs, not routed requests:
no retries, not counted in a server's load); the caller waits for them at most ``TIMEOUT_S``. A
server that does not answer in time, or fails, keeps its last good reading, marked ``stale``
with the ``error``; a scrape still running is not started again."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from miles_telemetry.prom import engine_reading

from .router import Router, Server

TIMEOUT_S = 2.0


class ServerStats:
    def __init__(self, router: Router, loop: asyncio.AbstractEventLoop) -> None:
        self.router, self.loop = router, loop
        self._text: dict[int, str] = {}  # server index -> its last /metrics answer
        self._error: dict[int, str] = {}  # server index -> why its last scrape failed
        self._fetch: concurrent.futures.Future | None = None

    def read(self) -> list[dict[str, Any]]:
        """One reading per server, in the order of ``engine.urls``; never raises."""
        if self.loop.is_running() and (self._fetch is None or self._fetch.done()):
            self._fetch = asyncio.run_coroutine_threadsafe(self._scrape_all(), self.loop)
        if self._fetch is not None:
            try:
                self._fetch.result(timeout=TIMEOUT_S)
            except (Exception, concurrent.futures.CancelledError):  # noqa: BLE001 - last readings then
                pass
        out = []
        for i, server in enumerate(self.router.servers):
            text, error = self._text.get(i), self._error.get(i)
            reading: dict[str, Any] = {"name": server.url}
            if text is not None:
                try:
                    reading.update(engine_reading(text))
                except Exception as e:  # noqa: BLE001 - an answer we cannot read counts as a failed scrape
                    error = error or f"{type(e).__name__}: {e}"[:200]
            if error is not None:
                reading.update(stale=True, error=error)
            out.append(reading)
        return out

    async def _scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(i, s) for i, s in enumerate(list(self.router.servers))))

    async def _scrape(self, i: int, server: Server) -> None:
        try:
            if not server.healthy:
                raise ConnectionError(server.last_error or "down")
            self._text[i] = await self.router.scrape(server, "/metrics", TIMEOUT_S)
            self._error.pop(i, None)
        except Exception as e:  # noqa: BLE001 - any failure: the last good reading, marked stale
            error = f"{type(e).__name__}: {e}"[:200] if str(e) else type(e).__name__
            if "HTTP 404" in error:
                error += " (SGLang serves /metrics with --enable-metrics)"
            self._error[i] = error
