import os
import subprocess
import sys
import textwrap
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


def install_plugin_dist(tmp_path: Path, name: str, version: str, module_code: str) -> Path:
    """Build and pip-install a real third-party ``miles-plugin-<name>`` distribution into its own
    folder (put it on PYTHONPATH to use it); its module body is ``module_code``."""
    src, site = tmp_path / f"src-{name}", tmp_path / f"site-{name}"
    pkg = src / f"miles_plugin_{name}"
    pkg.mkdir(parents=True)
    (src / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "miles-plugin-{name}"
        version = "{version}"
        [project.entry-points."miles.plugins"]
        {name} = "miles_plugin_{name}"
        [tool.setuptools]
        packages = ["miles_plugin_{name}"]
    """))
    (pkg / "__init__.py").write_text(textwrap.dedent(module_code))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True)
    return site


@pytest.fixture(scope="session")
def install_dist():
    """``install_plugin_dist`` (a fixture: test modules here cannot import conftest)."""
    return install_plugin_dist
