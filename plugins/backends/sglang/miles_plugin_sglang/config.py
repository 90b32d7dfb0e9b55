"""Config of the ``sglang`` engine (``engine: {name: sglang, urls: [...]}``)."""
from typing import Optional

import pydantic
from pydantic import Field, field_validator, model_validator


class SGLangEngineConfig(pydantic.BaseModel, extra="forbid"):
    urls: list[str] = Field(
        ..., min_length=1, description="base URLs of the servers (SGLang's launch_server or `miles "
        "serve`), e.g. [http://127.0.0.1:30000]; requests are spread over them")
    urls_file: Optional[str] = Field(
        None, description="a JSON list of the servers' current URLs (same order as urls) that a launcher "
        "rewrites when a restarted server comes back at another address; read when a server is down")
    api_key: Optional[str] = Field(
        None, description="sent as 'Authorization: Bearer KEY' (SGLang's --api-key); unset: read "
        "from the environment variable named by api_key_env")
    api_key_env: str = Field(
        "MILES_SGLANG_API_KEY", description="environment variable holding the API key when api_key is "
        "unset (keeps the key out of the run's saved config)")
    timeout_s: float = Field(600.0, gt=0, description="seconds one HTTP request may take (generation "
                             "and weight updates alike)")
    max_retries: int = Field(3, ge=0, description="times a failed request is re-sent, each time to "
                             "another healthy server")
    max_concurrency: int = Field(256, ge=1, description="HTTP requests in flight at once, all servers together")
    requests_per_call: Optional[int] = Field(None, ge=1, description="batched /generate requests one "
                                             "generate() call is split into (default: one per "
                                             "routable server; a group's samples stay together)")
    seeded_requests: bool = Field(False, description="send each prompt a sampling_seed derived from the "
                                  "step's seed (reproducible draws; a server cannot batch seeded "
                                  "requests together, so rollout gets much slower)")
    restart_wait_s: float = Field(120.0, ge=0, description="when no server is left, seconds to wait for "
                                  "one to come back (a launcher restarting it) before the request fails")
    health_check_interval_s: float = Field(5.0, gt=0, description="seconds between background health "
                                           "checks; a failed server is left out until one passes")
    startup_timeout_s: float = Field(120.0, ge=0, description="seconds to wait for the servers to answer "
                                     "when the engine is built")
    weights_dir: Optional[str] = Field(
        None, description="load_weights writes each version here (a folder the servers can read: "
        "shared disk or the same machine) and has them load it; default: a temporary folder")
    ranks_per_server: Optional[list[int]] = Field(
        None, description="ranks each server takes in a weight-update process group (its tensor-"
        "parallel size for SGLang); default 1 each (`miles serve`)")

    @field_validator("urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        out = []
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"{u!r} is not an http(s) URL (write http://HOST:PORT)")
            out.append(u.rstrip("/"))
        if len(set(out)) != len(out):
            raise ValueError("the same URL is listed twice")
        return out

    @model_validator(mode="after")
    def _ranks(self):
        ranks = self.ranks_per_server
        if ranks is not None and (len(ranks) != len(self.urls) or min(ranks) < 1):
            raise ValueError(f"ranks_per_server needs one positive entry per url ({len(self.urls)}), "
                             f"got {ranks}")
        return self
