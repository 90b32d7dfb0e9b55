import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd=None, timeout=600, env=None):
    """Run the ``miles`` CLI in a subprocess, as a user would."""
    e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "miles.cli", *args], cwd=cwd or ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli

