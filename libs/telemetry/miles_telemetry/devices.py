"""Device readings for the dashboard: every GPU's utilisation and memory through NVML when the
machine has one, this process's CPU use and resident memory (its children's too) always."""
from __future__ import annotations

import time
from typing import Any


class DeviceReader:
    """``read()``: one reading as a plain dict. NVML (``nvidia-ml-py``) is imported on the first
    reading and only used when it finds a GPU, so a CPU machine needs neither library nor driver."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] | None = None
        import psutil

        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # the first call only starts the interval

    def _gpus(self) -> list[dict[str, float]]:
        if self._handles is None:
            self._handles = []
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            except Exception:  # noqa: BLE001 - no library, no driver or no device: CPU readings only
                self._handles = []
        out = []
        for i, h in enumerate(self._handles):
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(h)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
                out.append({"index": i, "util_percent": float(util.gpu), "mem_used_bytes": float(mem.used),
                            "mem_total_bytes": float(mem.total)})
            except Exception:  # noqa: BLE001 - a device that stops answering is left out of this reading
                continue
        return out

    def read(self) -> dict[str, Any]:
        import psutil

        rss = self._proc.memory_info().rss
        for child in self._proc.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except psutil.Error:
                pass
        return {"time": time.time(), "cpu_percent": self._proc.cpu_percent(None),
                "system_cpu_percent": psutil.cpu_percent(None), "rss_bytes": float(rss),
                "mem_total_bytes": float(psutil.virtual_memory().total), "gpus": self._gpus()}
