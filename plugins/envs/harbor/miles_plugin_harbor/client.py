"""Client of ``harbor serve``'s HTTP API: submit a job, poll it, list and read its rollouts.

Every request has a timeout. Harbor answers errors as RFC 9457 problem documents; their
``detail`` is what the ``HarborError`` says.
"""
from __future__ import annotations

import os
import uuid
from typing import Any

from miles import MilesError

API_VERSION = "2026-10-30"  # the Harbor-API-Version harbor 0.26 speaks
TERMINAL = {"finished", "cancelled"}


class HarborError(MilesError):
    """The server answered an error, or could not be reached."""


class HarborClient:
    def __init__(self, base_url: str, *, timeout_s: float = 30.0, api_key_env: str = "HARBOR_API_KEY"):
        import httpx

        self.base_url = base_url.rstrip("/")
        headers = {"Harbor-API-Version": API_VERSION}
        if os.environ.get(api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s, trust_env=False)

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        import httpx

        try:
            r = self._http.request(method, path, **kw)
        except httpx.ConnectError as e:
            raise HarborError(f"cannot connect to the Harbor server at {self.base_url} ({e}); start it "
                              "(python -m miles_plugin_harbor.launch) or fix env.server_url") from e
        except httpx.TimeoutException as e:
            raise HarborError(f"{method} {self.base_url}{path}: no answer in time ({type(e).__name__})") from e
        if r.status_code >= 400:
            try:
                problem = r.json()
                detail = problem.get("detail") or problem.get("title")
            except ValueError:
                detail = r.text[:300]
            raise HarborError(f"{method} {self.base_url}{path}: HTTP {r.status_code}: {detail}")
        try:
            return r.json()
        except ValueError as e:
            raise HarborError(f"{method} {self.base_url}{path}: answered non-JSON {r.text[:200]!r}") from e

    def sandboxes(self) -> list[str]:
        return self._call("GET", "/sandboxes")["sandboxes"]

    def agents(self) -> list[str]:
        return self._call("GET", "/agents")["agents"]

    def submit(self, config: dict, dry_run: bool = False) -> dict:
        """``{"job_id": ...}``, or ``{"n_trials": N}`` for a dry run."""
        headers = {} if dry_run else {"Idempotency-Key": uuid.uuid4().hex}
        return self._call("POST", "/jobs/submit", json={"config": config, "dry_run": dry_run}, headers=headers)

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/jobs/{job_id}")["job"]

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/jobs/{job_id}/cancel", json={"force": True})

    def rollouts(self, job_id: str) -> list[dict]:
        """Every rollout summary of the job (all pages)."""
        out, token = [], ""
        while True:
            page = self._call("GET", "/rollouts", params={"job_ids": job_id, "page_size": 100, "page_token": token})
            out += page.get("items", [])
            token = page.get("next_page_token") or ""
            if not token:
                return out

    def rollout(self, rollout_id: str) -> dict:
        return self._call("GET", f"/rollouts/{rollout_id}")["rollout"]

    def close(self) -> None:
        self._http.close()
