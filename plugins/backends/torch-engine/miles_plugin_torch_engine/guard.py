"""The outermost layer of ``miles serve``'s app: the API key, a body size limit and a body read
timeout, and JSON errors for whatever a route did not handle; and the key and bind rules checked
at start.

The key is checked on the headers alone, before a byte of the body is read, so an
unauthenticated client cannot hold a connection open with a slow body. Every body is then read
here, up to ``max_body_bytes`` and within ``body_timeout_s``, before any route sees it: a larger
one is answered 413 without being buffered whole (a chunked upload is cut off at the limit), a
slower one 408. A route that raises still answers with a JSON error (400 for JSON nested too
deeply to parse, else 500) and one log line, not a traceback, so bad input cannot fill the log
or take the server down.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any

from miles import MilesError

LOG = logging.getLogger("miles.serve")
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
DEFAULT_MAX_BODY_MB = 8.0
DEFAULT_BODY_TIMEOUT_S = 30.0


async def _send_json(send: Any, status: int, body: dict, close: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if close:  # the rest of the body is not read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class Guard:
    """ASGI middleware: API key, body limits, exceptions as JSON errors (see the module docstring)."""

    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None = None,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.app = app
        self.max_body_bytes = int(max_body_bytes)
        self.body_timeout_s = float(body_timeout_s)
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        # Stricter than SGLang's add_api_key_middleware (utils/common.py), which lets /health*
        # through: here every route needs the key, health probes included.
        if self.expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""),
                                                                 self.expected):
            return await _send_json(send, 401, {"error": "Unauthorized"}, close=True)
        too_big = {"error": {"message": f"request body larger than {self.max_body_bytes} bytes "
                                        f"(the server's max_body_mb setting)"}}
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await _send_json(send, 413, too_big, close=True)
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
        except asyncio.TimeoutError:
            return await _send_json(send, 408, {"error": {"message": (
                f"request body not received within {self.body_timeout_s:g} s (the server's "
                f"body_timeout_s setting)")}}, close=True)
        if body is None:  # the client went away mid-body
            return None
        if len(body) > self.max_body_bytes:
            return await _send_json(send, 413, too_big, close=True)
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replayed, tracked)
        except RecursionError:
            if not started:
                await _send_json(send, 400, {"error": {"message": "JSON nested too deeply"}})
        except Exception as e:  # noqa: BLE001 - answered, logged in one line, server keeps serving
            LOG.error("miles serve: %s %s failed: %s: %s", scope.get("method"), scope.get("path"),
                      type(e).__name__, str(e)[:300])
            if not started:
                await _send_json(send, 500, {"error": {"message": f"internal error: {type(e).__name__}"}})

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body; stops at one byte over the limit; None if the client disconnected."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                break
            more = message.get("more_body", False)
        return b"".join(chunks)


def check_api_key(api_key: str) -> None:
    """A key clients can send: visible ASCII, no surrounding blanks (HTTP strips those from a
    header, so a blank key would refuse every request)."""
    if not api_key.strip():
        raise MilesError("--api-key is blank: give a non-empty key (or leave --api-key out on 127.0.0.1)")
    if api_key != api_key.strip() or not all(33 <= ord(c) < 127 for c in api_key):
        raise MilesError("--api-key: use printable ASCII without spaces (clients send it in an HTTP "
                         "header, which cannot carry the rest)")


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to expose an unauthenticated engine beyond this machine."""
    if host not in LOOPBACK and not api_key:
        raise MilesError(f"--host {host} exposes the server beyond this machine: pass --api-key KEY "
                         f"(clients then send 'Authorization: Bearer KEY'), or bind 127.0.0.1")
