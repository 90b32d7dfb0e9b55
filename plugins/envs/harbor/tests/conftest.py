"""Servers of the integration tests: ``harbor serve`` (Harbor's own Python 3.12 venv, trials in
podman containers from a locally built image) and ``miles serve`` with a tiny policy. Each is
started once per test module (so none outlives its tests in a long test run), stopped after it
and checked to be gone."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from miles.testing import require_commands
from miles_procs import unused_port

ROOT = Path(__file__).resolve().parents[4]




def _container_runs(server) -> str:
    """'' when podman runs a container from the base image here, else why not."""
    from miles_plugin_harbor.launch import BASE_IMAGE, ensure_base_image, ensure_venv

    server.work_dir.mkdir(parents=True, exist_ok=True)
    env = server.environment(ensure_venv())
    try:
        ensure_base_image(env)
        p = subprocess.run(["podman", "run", "--rm", BASE_IMAGE, "true"], env=env, capture_output=True,
                           text=True, timeout=120)
    except Exception as e:  # noqa: BLE001 (any failure to start a container means no runtime)
        return f"{type(e).__name__}: {e}"
    return "" if p.returncode == 0 else p.stderr.strip()[-500:]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from miles_plugin_harbor.launch import HarborServer
    from miles_procs import session_pids

    require_commands({"podman": "podman", "runc": "runc"})  # Harbor trials here run in podman
    s = HarborServer(unused_port(), tmp_path_factory.mktemp("harbor"))
    probe = _container_runs(s)
    if probe:  # a host whose kernel or sandbox cannot run containers at all (not a failure of ours)
        pytest.skip(f"podman cannot run a container on this host: {probe}")
    sid = None
    try:
        s.start()
        sid = s.proc.pid
        yield s
    finally:
        s.stop()
    if sid is not None:
        assert session_pids(sid) == [], "harbor serve processes left behind"


@pytest.fixture(scope="module")
def policy_started(tmp_path_factory):
    """``miles serve`` of a tiny random policy, started but not yet waited for; a module that needs
    it and ``server`` names it first (``usefixtures``) so both servers load at once."""
    from miles_plugin_harbor import tiny_policy

    base = tmp_path_factory.mktemp("policy")
    folder = tiny_policy.write(base / "policy")
    log = base / "serve.log"
    port = unused_port()
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(folder), "--port", str(port)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    try:
        yield {"dir": folder, "url": f"http://127.0.0.1:{port}", "proc": proc, "reader": reader, "line": line,
               "log": log}
    finally:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def policy(policy_started):
    """``miles serve`` of a tiny random policy, listening: ``{"dir": folder, "url": base URL, "proc": process}``."""
    p = policy_started
    p["reader"].join(180)
    if not (p["line"] and f"listening on {p['url']}" in p["line"][0]):
        pytest.fail(f"miles serve did not start: {p['line']}; {p['log'].read_text()[-2000:]}")
    return {k: p[k] for k in ("dir", "url", "proc")}
