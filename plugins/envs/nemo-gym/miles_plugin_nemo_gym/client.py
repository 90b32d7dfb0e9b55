"""HTTP client of a NeMo Gym agent server: ``POST /run`` per trajectory, all of a batch at once.

Every request is bounded by a timeout and the whole batch by one deadline, so a slow or hung
server fails samples instead of stalling training.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from miles import MilesError


class AgentDown(MilesError):
    """The agent server could not be reached at all."""


class RunFailed(Exception):
    """One trajectory failed: an HTTP error, a timeout, or an answer that is not a rewarded run."""


def run_all(url: str, bodies: list[dict], *, timeout_s: float, connect_timeout_s: float,
            max_concurrency: int) -> list[dict | Exception]:
    """POST each body to ``{url}/run``; per body the agent's JSON answer or the exception it raised."""
    return asyncio.run(_run_all(url.rstrip("/"), bodies, timeout_s, connect_timeout_s, max_concurrency))


async def _run_all(url: str, bodies: list[dict], timeout_s: float, connect_timeout_s: float,
                   max_concurrency: int) -> list[dict | Exception]:
    import httpx

    limit = asyncio.Semaphore(max_concurrency)
    timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        async def one(body: dict) -> dict:
            async with limit:
                # wait_for bounds the whole request: httpx's timeouts are per read, so a server
                # trickling bytes could otherwise hold a request open indefinitely
                return await asyncio.wait_for(_post(client, f"{url}/run", body), timeout_s)

        return await asyncio.gather(*(one(b) for b in bodies), return_exceptions=True)


async def _post(client: Any, url: str, body: dict) -> dict:
    import httpx

    try:
        r = await client.post(url, json=body)
    except httpx.ConnectError as e:
        raise AgentDown(f"cannot connect to the NeMo Gym agent at {url} ({e}); start the servers "
                        "(python -m miles_plugin_nemo_gym.launch) or fix env.agent_url") from e
    if r.status_code != 200:
        raise RunFailed(f"{url} answered HTTP {r.status_code}: {r.text[:300]}")
    try:
        out = r.json()
    except json.JSONDecodeError as e:
        raise RunFailed(f"{url} answered non-JSON: {r.text[:200]!r}") from e
    if not isinstance(out, dict):
        raise RunFailed(f"{url} answered {type(out).__name__}, not a JSON object")
    return out


def health(url: str, timeout_s: float = 5.0) -> bool:
    """Whether something answers HTTP at ``url`` (any status: a FastAPI server 404s on ``/``)."""
    import httpx

    try:
        httpx.get(url, timeout=timeout_s, trust_env=False)
        return True
    except httpx.HTTPError:
        return False
