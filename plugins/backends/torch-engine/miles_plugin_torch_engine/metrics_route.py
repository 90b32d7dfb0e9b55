"""``GET /metrics``: the server's gauges and counters in Prometheus' text format, under the stable
names of ``miles_telemetry.prom`` (``miles_engine_*``), behind the same API key as every route."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response

COUNTERS = {"num_requests": "engine_requests_total", "num_batches": "engine_batches_total",
            "num_engine_calls": "engine_calls_total", "num_aborted": "engine_aborted_requests_total",
            "num_cancelled": "engine_cancelled_requests_total", "cancelled_tokens": "engine_cancelled_tokens_total"}
HELP = {"engine_requests_running": "requests in the batch on the engine now",
        "engine_requests_queued": "requests waiting for the engine", "engine_weight_version": "weight version served",
        "engine_paused": "1 while generation is paused (a weight update)",
        "engine_requests_total": "generation requests received",
        "engine_running_sequences": "sequences (samples) decoding now",
        "engine_queued_sequences": "sequences waiting: queued requests' samples and rows waiting for a cache row",
        "engine_kv_cache_usage": "share of the allocated KV cache the decoding sequences hold (0-1)",
        "engine_spec_accept_rate": "speculative drafts accepted / drafted in the last engine call",
        "engine_generated_tokens_total": "tokens generated"}
# the engine's own reading (miles.protocols.EngineStats) -> gauge; these names are what the sglang
# client's engine_stats() reads back (miles_telemetry.prom.ENGINE_READINGS)
READING_GAUGES = {"running": "engine_running_sequences", "queued": "engine_queued_sequences",
                  "kv_cache_usage": "engine_kv_cache_usage", "spec_accept_rate": "engine_spec_accept_rate"}


def mount_metrics_route(app: FastAPI, engine: Any, scheduler: Any) -> None:
    from miles.protocols import EngineStats
    from miles_telemetry.prom import CONTENT_TYPE, exposition, registry

    def snapshot() -> tuple[dict[str, float], dict[str, float]]:
        stats = dict(scheduler.stats)
        gauges = {"engine_requests_running": stats.get("num_running", 0),
                  "engine_requests_queued": scheduler.num_waiting, "engine_weight_version": engine.weight_version,
                  "engine_paused": float(bool(scheduler.paused))}
        counters = {name: stats[key] for key, name in COUNTERS.items() if key in stats}
        if isinstance(engine, EngineStats):  # plain counters: reading them never waits on generation
            reading = {k: v for e in engine.engine_stats() for k, v in e.items()}
            reading["queued"] = reading.get("queued", 0) + scheduler.waiting_samples
            gauges.update({name: reading[key] for key, name in READING_GAUGES.items() if key in reading})
            if "generated_tokens" in reading:
                counters["engine_generated_tokens_total"] = reading["generated_tokens"]
        return gauges, counters

    reg = registry(snapshot, helps=HELP)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition (``prometheus_client``)."""
        return Response(exposition(reg), media_type=CONTENT_TYPE)
