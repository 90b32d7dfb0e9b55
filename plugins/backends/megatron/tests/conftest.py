import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # cpu_shim, helpers


@pytest.fixture(scope="module")
def megatron_cpu():
    """megatron-core on CPU (``miles_plugin_megatron.cpu``) with one process group for the module,
    torn down after it (other tests' trainers start clean)."""
    from miles_plugin_megatron.cpu import on_cpu

    with on_cpu():
        yield
