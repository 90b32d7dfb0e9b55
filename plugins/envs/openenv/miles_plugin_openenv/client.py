"""Episodes on an OpenEnv server through OpenEnv's own WebSocket ``GenericEnvClient``.

One background event loop drives every session, so a rollout steps all of its episodes
concurrently from synchronous code; every call is bounded by a timeout (never a hang).
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from miles import MilesError


class EnvServerError(MilesError):
    """The env server was unreachable, too slow, or answered something unusable."""


@dataclass
class StepOut:
    observation: dict
    reward: float | None
    done: bool


class Sessions:
    """Opens, drives and closes WebSocket sessions (one per episode) on ``base_url``."""

    def __init__(self, base_url: str, connect_timeout_s: float, message_timeout_s: float):
        self.base_url, self.connect_timeout_s = base_url, connect_timeout_s
        self.message_timeout_s = message_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="openenv-sessions")
        self._thread.start()

    def _run(self, coro: Any, budget_s: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout=budget_s)
        except TimeoutError:  # concurrent.futures.TimeoutError is TimeoutError on 3.11
            fut.cancel()
            raise

    def open(self, count: int) -> list[Any]:
        """``count`` connected clients, or ``EnvServerError`` naming the server and the fix."""
        from openenv.core.generic_client import GenericEnvClient

        async def _open() -> list[Any]:
            clients = [GenericEnvClient(base_url=self.base_url, connect_timeout_s=self.connect_timeout_s,
                                        message_timeout_s=self.message_timeout_s) for _ in range(count)]
            done = await asyncio.gather(*(c.connect() for c in clients), return_exceptions=True)
            errors = [d for d in done if isinstance(d, BaseException)]
            if errors:  # close the sessions that did open, so the server does not keep them
                await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
                raise errors[0]
            return clients

        try:
            return self._run(_open(), self.connect_timeout_s + 5)
        except Exception as e:
            raise EnvServerError(f"cannot open {count} OpenEnv session(s) at {self.base_url} "
                                 f"({type(e).__name__}: {e}); is the server running (env.base_url)?") from e

    def call_all(self, calls: list[tuple[Any, str, Any]]) -> list[StepOut | Exception]:
        """Run ``(client, "reset"|"step", arg)`` calls concurrently; each answer is a ``StepOut``
        or the exception that call raised (a timeout, a dropped connection, a malformed answer)."""

        async def _one(client: Any, kind: str, arg: Any) -> StepOut:
            res = await (client.reset(seed=arg) if kind == "reset" else client.step(arg))
            return _checked(res)

        async def _all() -> list[Any]:
            return await asyncio.gather(*(_one(*c) for c in calls), return_exceptions=True)

        try:
            return self._run(_all(), self.message_timeout_s + 5)
        except TimeoutError:
            return [EnvServerError(f"no answer from {self.base_url} in {self.message_timeout_s}s")] * len(calls)

    def close(self, clients: list[Any]) -> None:
        async def _close() -> None:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

        try:
            self._run(_close(), 5)
        except Exception:  # closing is best effort: the server drops idle sessions itself
            pass

    def shutdown(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def _checked(res: Any) -> StepOut:
    obs, reward, done = res.observation, res.reward, res.done
    if not isinstance(obs, dict) or not isinstance(done, bool) or not (
            reward is None or (isinstance(reward, (int, float)) and not isinstance(reward, bool))):
        raise EnvServerError(f"malformed OpenEnv answer: observation={obs!r:.200} reward={reward!r} "
                             f"done={done!r}")
    return StepOut(obs, None if reward is None else float(reward), done)


def field_text(obs: dict, name: str, what: str) -> str:
    """The text of observation field ``name``; a clear error naming the config key otherwise."""
    value = obs.get(name)
    if not isinstance(value, str):
        raise MilesError(f"the OpenEnv observation has no text field {name!r} ({what}); it has "
                         f"{sorted(obs)}: set env.{what} to one of them")
    return value
