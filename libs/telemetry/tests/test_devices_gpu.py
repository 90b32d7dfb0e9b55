"""On a CUDA machine the device reader sees every GPU through NVML, and its memory reading moves
with what the process allocates (the dashboard's devices panel shows these readings)."""
import pytest
import torch

from miles_telemetry.devices import DeviceReader


@pytest.mark.gpu
def test_nvml_reads_every_gpu_and_follows_an_allocation():
    if not torch.cuda.is_available():
        pytest.fail("a gpu test needs CUDA (run it on a CUDA machine: pytest -m gpu)")
    reader = DeviceReader()
    before = reader.read()["gpus"]
    assert len(before) == torch.cuda.device_count()
    assert all(0.0 <= g["util_percent"] <= 100.0 and 0 < g["mem_used_bytes"] <= g["mem_total_bytes"] for g in before)
    block = torch.empty(2 << 30, dtype=torch.uint8, device="cuda:0")  # 2 GiB
    torch.cuda.synchronize()
    after = reader.read()["gpus"]
    grown = after[0]["mem_used_bytes"] - before[0]["mem_used_bytes"]
    del block
    assert grown >= 1.9 * (1 << 30), grown
