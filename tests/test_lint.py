"""The code passes the project's linter (ruff, configured in pyproject.toml), as part of the suite."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
