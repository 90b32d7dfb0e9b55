"""Suite-wide set-up, so that `python -m pytest` alone prepares what the tests need: the env
connectors' own virtualenvs (NeMo Gym, Harbor, Verifiers: minutes each) start building in the
background as soon as tests that use them are collected, while the other tests run; a test that
needs one waits on the build's lock (``scripts/make_venv.sh``)."""
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CONNECTORS = ("nemo-gym", "harbor", "verifiers")
# seconds each test file takes (setup, calls and teardown on a 2-core machine), refreshed with
# `.ci/durations.py`; they only order the files (see pytest_collection_modifyitems)
DURATIONS = ROOT / ".ci" / "test_durations.json"
VENV_LEAD = 1200  # DURATIONS seconds queued ahead of the connectors' files: ~5 minutes of both workers

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


def pytest_collection_modifyitems(config, items):
    """The longest test files first, each file's tests in their own order. The two xdist workers
    take whole files from this queue as they free up (``--dist loadfile --no-loadscope-reorder``),
    so a long file does not start last and leave one worker running alone at the end. A file not
    in ``DURATIONS`` counts as a median one. The env connectors' files wait until files worth
    ``VENV_LEAD`` seconds are queued ahead of them: their venvs build in the meantime (about 4-7
    minutes from a clean clone), so a worker does not sit on a build's lock."""
    try:
        seconds = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    default = statistics.median(seconds.values()) if seconds else 0.0
    files: dict[Path, float] = {}
    for item in items:
        if item.path not in files:
            rel = item.path.relative_to(ROOT).as_posix() if item.path.is_relative_to(ROOT) else str(item.path)
            files[item.path] = seconds.get(rel, default)
    connector = {f for f in files if any(f"plugins/envs/{c}/" in f.as_posix() for c in CONNECTORS)}
    queue = sorted((f for f in files if f not in connector), key=lambda f: -files[f])
    ahead, lead = 0, 0.0
    while ahead < len(queue) and lead < VENV_LEAD:
        lead += files[queue[ahead]]
        ahead += 1
    queue = queue[:ahead] + sorted(queue[ahead:] + sorted(connector, key=str), key=lambda f: -files[f])
    rank = {f: i for i, f in enumerate(queue)}
    items.sort(key=lambda item: rank[item.path])  # stable: a file's tests keep their order
