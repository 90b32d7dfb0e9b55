"""TEST-ONLY launch-time plugin: installs tests/cpu_shim.py's CPU stand-ins when a rank loads it
(``--plugin``), so multi-rank ``miles train`` runs of the megatron trainer work on a CPU machine."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import cpu_shim  # noqa: E402

cpu_shim.install(pytest.MonkeyPatch())
