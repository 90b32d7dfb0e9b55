"""HTTP client of the verifiers worker (``worker/server.py``): every call bounded by a timeout."""
from __future__ import annotations

from typing import Any

from miles import MilesError


class WorkerError(MilesError):
    """The verifiers worker was unreachable or answered something unusable."""


class WorkerClient:
    def __init__(self, url: str, connect_timeout_s: float, timeout_s: float):
        import httpx

        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))

    def call(self, path: str, body: dict | None = None) -> dict:
        """The worker's JSON answer; ``WorkerError`` naming the worker (and ``env.worker_url``) when
        it is down, too slow, or its answer is not a JSON object."""
        import httpx

        try:
            r = (self._http.post(f"{self.url}{path}", json=body) if body is not None
                 else self._http.get(f"{self.url}{path}"))
        except httpx.ConnectError as e:
            raise WorkerError(f"cannot reach the verifiers worker at {self.url} ({e}); is it running "
                              f"(plugins/envs/verifiers/README.md, env.worker_url)?") from e
        except httpx.TimeoutException as e:
            raise WorkerError(f"the verifiers worker at {self.url} gave no answer to {path} in "
                              f"{self.timeout_s}s (env.timeout_s + env.reply_grace_s)") from e
        except httpx.HTTPError as e:
            raise WorkerError(f"the verifiers worker at {self.url} failed on {path}: {type(e).__name__}: {e}") from e
        try:
            data: Any = r.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise WorkerError(f"the verifiers worker at {self.url} answered {path} with HTTP {r.status_code} "
                              f"and no JSON object: {r.text[:200]!r}")
        if r.status_code != 200:
            raise WorkerError(f"the verifiers worker at {self.url} refused {path} (HTTP {r.status_code}): "
                              f"{data.get('error', data)}")
        return data

    def close(self) -> None:
        self._http.close()
