"""Suite-wide set-up, so that `python -m pytest` alone prepares what the tests need: the env
connectors' own virtualenvs (NeMo Gym, Harbor, Verifiers: minutes each) start building in the
background as soon as tests that use them are collected, while the other tests run; a test that
needs one waits on the build's lock (``scripts/make_venv.sh``)."""
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CONNECTORS = ("nemo-gym", "harbor", "verifiers")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: a second torch thread per process (and per child run) only waits
    # for a core the other worker holds; a test or run that sets its own thread count still does
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_finish(session):
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":  # every worker collects; one starts the builds
        return
    wanted = {c for c in CONNECTORS for item in session.items
              if f"plugins/envs/{c}/" in str(item.path).replace("\\", "/")}
    logs = Path(tempfile.gettempdir()) / "miles-venv-logs"
    for name in sorted(wanted):
        logs.mkdir(exist_ok=True)
        with open(logs / f"{name}.log", "w") as log:
            subprocess.Popen(["bash", str(ROOT / "plugins/envs" / name / "scripts/make_venv.sh")], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
