"""Real servers for the verifiers connector's tests: verifiers' own virtualenv (built once by
scripts/make_venv.sh), the verifiers worker in it, and a ``miles serve`` policy."""
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from miles_procs import unused_port

PLUGIN = Path(__file__).resolve().parents[1]
ROOT = PLUGIN.parents[2]




@pytest.fixture(scope="session")
def vf_python() -> str:
    """The worker virtualenv's python (a cached build returns at once)."""
    p = subprocess.run(["bash", str(PLUGIN / "scripts/make_venv.sh")], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"make_venv.sh failed: {p.stderr[-3000:]}"
    return p.stdout.strip().splitlines()[-1]


def wait_http(url: str, proc: subprocess.Popen, log: Path, what: str, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s  # importing verifiers or torch is slow on a busy machine
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{what} did not come up: {log.read_text()[-3000:]}")
            time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="session")
def policy_started(tmp_path_factory):
    """``miles serve`` over the recipe's model (written by the plugin's policy helper), started but
    not yet waited for: ``(url, wait)``, where ``wait()`` blocks until it listens."""
    from miles_plugin_verifiers.policy import write_policy_folder

    folder = write_policy_folder(str(ROOT / "recipes/verifiers.yaml"), str(tmp_path_factory.mktemp("vf-policy") / "m"))
    log = tmp_path_factory.mktemp("vf-serve") / "serve.log"
    port = unused_port()
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(folder), "--port", str(port)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"

    def wait() -> None:
        reader.join(180)
        assert line and f"listening on {url}" in line[0], log.read_text()[-3000:]

    try:
        yield url, wait
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def worker_url(policy_started, vf_python, tmp_path_factory):
    """The verifiers worker. The tests that use it use the policy server too, so ``policy_started``
    starts that one first: it loads while the worker's virtualenv is ready-checked and the worker loads."""
    port = unused_port()
    log = tmp_path_factory.mktemp("vf-worker") / "worker.log"
    proc = subprocess.Popen([vf_python, str(PLUGIN / "worker/server.py"), "--port", str(port), "--max-tasks", "256"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc, log, "the verifiers worker")
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def policy_url(policy_started):
    url, wait = policy_started
    wait()
    return url
