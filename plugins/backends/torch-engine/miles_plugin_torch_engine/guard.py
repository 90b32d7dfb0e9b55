"""The outermost layer of ``miles serve``'s app: a body size limit and JSON errors for whatever a
route did not handle.

Every body is read here, up to ``max_body_bytes``, before any route sees it: a larger one is
answered 413 without being buffered whole (a chunked upload is cut off at the limit). A route
that raises still answers with a JSON error (400 for JSON nested too deeply to parse, else 500)
and one log line, not a traceback, so bad input cannot fill the log or take the server down.
"""
from __future__ import annotations

import json
import logging
from typing import Any

LOG = logging.getLogger("miles.serve")
DEFAULT_MAX_BODY_MB = 8.0


async def _send_json(send: Any, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class Guard:
    """ASGI middleware: body size limit, exceptions as JSON errors (see the module docstring)."""

    def __init__(self, app: Any, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = int(max_body_bytes)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = {"error": {"message": f"request body larger than {self.max_body_bytes} bytes "
                                        f"(the server's max_body_mb setting)"}}
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await _send_json(send, 413, too_big)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await _send_json(send, 413, too_big)
            more = message.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

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
