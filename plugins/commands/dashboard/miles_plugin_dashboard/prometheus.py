"""Logger ``prometheus``: the latest step's metrics as Prometheus gauges on trainer rank 0, served on
an opt-in port (``loggers: [{name: prometheus, port: 9400}]``) for a scraper to read while the run
trains. Names: ``miles_<metric>`` (``miles_reward_mean``, ``miles_mfu``...), ``miles_step`` and the
counter ``miles_steps_logged_total``."""
from __future__ import annotations

from typing import Any

from miles import MilesError
from pydantic import BaseModel, ConfigDict, Field


class PrometheusConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    port: int = Field(ge=0, le=65535, description="TCP port of /metrics (0 picks a free one, printed)")
    host: str = Field("127.0.0.1", description="address to bind (a scraper on another machine needs 0.0.0.0)")


class PrometheusLogger:
    def __init__(self, cfg: PrometheusConfig) -> None:
        from miles_telemetry.prom import StepGauges

        try:
            self.gauges = StepGauges(cfg.host, cfg.port)
        except OSError as e:
            raise MilesError(f"loggers: prometheus cannot listen on {cfg.host}:{cfg.port} ({e.strerror}); "
                             f"pick another port (0 picks a free one)") from None
        print(f"miles: prometheus metrics on http://{cfg.host}:{self.gauges.port}/metrics", flush=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.gauges.update(step, metrics)

    def close(self) -> None:
        self.gauges.close()


def make_logger(cfg: PrometheusConfig, **_: Any) -> PrometheusLogger:
    return PrometheusLogger(cfg)
