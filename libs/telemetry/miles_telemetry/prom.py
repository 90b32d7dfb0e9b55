"""Prometheus text exposition of miles' gauges and counters, through the official
``prometheus_client`` (imported when a ``/metrics`` endpoint is made, not before).

Names are stable: ``miles_<metric>`` for a step metric (``reward_mean`` -> ``miles_reward_mean``),
``miles_engine_<name>`` for an engine's; counters end in ``_total``.
"""
from __future__ import annotations

import re
import threading
from typing import Any, Callable, Iterator

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def metric_name(key: str, prefix: str = "miles_") -> str:
    """A Prometheus metric name for a miles metric key (characters outside ``[a-zA-Z0-9_]``
    become ``_``)."""
    name = prefix + re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return name if not name[0].isdigit() else "_" + name


Snapshot = Callable[[], tuple[dict[str, float], dict[str, float]]]


def registry(snapshot: Snapshot, prefix: str = "miles_", helps: dict[str, str] | None = None) -> Any:
    """A ``prometheus_client`` registry that asks ``snapshot()`` for ``(gauges, counters)`` (plain
    ``{key: number}`` dicts, non-numbers skipped) on every scrape."""
    from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

    helps = helps or {}

    class _Collector:
        def collect(self) -> Iterator[Any]:
            gauges, counters = snapshot()
            for key, v in sorted(gauges.items()):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    yield GaugeMetricFamily(metric_name(key, prefix), helps.get(key, f"miles {key}"), value=float(v))
            for key, v in sorted(counters.items()):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    # the family's name has no _total; the exposition adds it to the sample
                    yield CounterMetricFamily(metric_name(key.removesuffix("_total"), prefix),
                                              helps.get(key, f"miles {key}"), value=float(v))

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector())
    return reg


def exposition(reg: Any) -> bytes:
    """The registry's current values in Prometheus' text format (``CONTENT_TYPE``)."""
    from prometheus_client import generate_latest

    return generate_latest(reg)


# an engine reading's keys (miles.protocols.EngineStats) -> the names that carry them on a server's
# /metrics: `miles serve`'s, then SGLang's (python/sglang/srt/metrics/collector.py; `--enable-metrics`),
# and how several samples of one name (labels: dp/tp ranks) combine
ENGINE_READINGS: dict[str, tuple[tuple[str, ...], str]] = {
    "running": (("miles_engine_running_sequences", "sglang:num_running_reqs"), "sum"),
    "queued": (("miles_engine_queued_sequences", "sglang:num_queue_reqs"), "sum"),
    "kv_cache_usage": (("miles_engine_kv_cache_usage", "sglang:token_usage"), "mean"),
    "generated_tokens": (("miles_engine_generated_tokens_total", "sglang:generation_tokens_total"), "sum"),
    "spec_accept_rate": (("miles_engine_spec_accept_rate", "sglang:spec_accept_rate"), "mean"),
}


def parse_samples(text: str) -> dict[str, list[float]]:
    """The sample values of a Prometheus text exposition by metric name (labels dropped; comment
    and malformed lines skipped)."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace != -1 and brace < line.find(" "):
            name, rest = line[:brace], line[line.rfind("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        try:
            out.setdefault(name, []).append(float(rest.split()[0]))
        except (IndexError, ValueError):
            continue
    return out


def engine_reading(text: str) -> dict[str, float]:
    """An engine reading (running, queued, kv_cache_usage, generated_tokens, spec_accept_rate: the
    ones present) from a server's ``/metrics`` text, `miles serve`'s or SGLang's."""
    samples = parse_samples(text)
    out: dict[str, float] = {}
    for key, (names, how) in ENGINE_READINGS.items():
        vals = next((samples[n] for n in names if samples.get(n)), None)
        if vals:
            out[key] = sum(vals) if how == "sum" else sum(vals) / len(vals)
    if not any(samples.get("sglang:spec_accept_length") or [0.0]) and "miles_engine_spec_accept_rate" not in samples:
        out.pop("spec_accept_rate", None)  # SGLang exports 0 when it does no speculative decoding
    return out


class StepGauges:
    """The latest step's metrics as gauges (plus ``miles_steps_logged_total``), served on a port of
    their own by ``prometheus_client``'s HTTP server: a trainer's rank 0 exposes them for scraping."""

    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        self._lock = threading.Lock()
        self._latest: dict[str, float] = {}
        self._count = 0
        self.server, self.thread = start_http_server(port, addr=host, registry=registry(self._snapshot))
        self.port = self.server.server_address[1]

    def _snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        with self._lock:
            return dict(self._latest), {"steps_logged_total": float(self._count)}

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        with self._lock:
            self._latest = {"step": float(step), **{k: v for k, v in metrics.items()
                                                    if isinstance(v, (int, float)) and not isinstance(v, bool)}}
            self._count += 1

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
