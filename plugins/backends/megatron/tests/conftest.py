import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # cpu_shim, helpers


@pytest.fixture(scope="module")
def megatron_cpu():
    """megatron-core on CPU (tests/cpu_shim.py) with one process group for the module, torn down
    after it (other tests' trainers start clean)."""
    import cpu_shim

    mp = pytest.MonkeyPatch()
    cpu_shim.install(mp)
    yield
    from miles_plugin_megatron import parallel

    parallel.destroy()
    mp.undo()
