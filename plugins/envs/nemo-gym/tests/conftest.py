import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest
from miles_procs import unused_port

ROOT = Path(__file__).resolve().parents[4]


def identity(pid: int) -> tuple[int, str] | None:
    """(pid, start time) of a live, non-zombie process: a pid the kernel reuses is another process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (pid, fields[19])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start_miles_serve(folder: Path, log: Path, port: int) -> tuple[subprocess.Popen, Callable[[], None]]:
    """``miles serve FOLDER`` on ``port``, started at once; the returned wait blocks until it listens,
    so the caller can start other servers while this one loads."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(folder), "--port", str(port)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()

    def wait() -> None:
        reader.join(180)
        if not (line and f"listening on http://127.0.0.1:{port}" in line[0]):
            proc.kill()
            pytest.fail(f"miles serve did not start: {line}; {log.read_text()[-2000:]}")

    return proc, wait


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The whole stack, each part in its own process: ``miles serve`` with a tiny policy, and
    ``ng_run`` (Ray head, miles_arith resources server, simple_agent, miles_model) in NeMo Gym's
    Python 3.12 venv. Everything started here is stopped at the end, and checked to be gone:
    ng_run's session and every process of NeMo Gym's own Ray (its daemons and workers)."""
    from miles_plugin_nemo_gym import tiny_policy
    from miles_plugin_nemo_gym.launch import GymServers, ensure_venv, ray_pids
    from miles_procs import session_pids

    base = tmp_path_factory.mktemp("nemo_gym")
    ensure_venv()  # cold: builds the venv (minutes); warm: returns at once
    folder = tiny_policy.write(base / "policy")
    port, agent_port, head_port, resources_port = (unused_port() for _ in range(4))
    url = f"http://127.0.0.1:{port}"
    # ng_run is given the model's name, so it needs no answer from miles serve to start: both load at once
    serve, serve_listens = start_miles_serve(folder, base / "serve.log", port)
    gym = GymServers(f"{url}/v1", agent_port, head_port, base / "gym", model_name=str(folder),
                     resources_port=resources_port)
    sid, ray_dir, ray_procs = None, None, []
    try:
        gym.start()
        serve_listens()
        sid, ray_dir = gym.proc.pid, gym.ray_dir
        ray_procs = [i for i in map(identity, ray_pids(ray_dir)) if i]
        daemons = {name for name in ("gcs_server", "raylet") for pid, _ in ray_procs if name in cmdline(pid)}
        # NeMo Gym's Ray lives in its own temp dir, with token auth: no other Ray client attaches to it
        assert daemons == {"gcs_server", "raylet"}, [cmdline(pid)[:200] for pid, _ in ray_procs]
        gcs = next(pid for pid, _ in ray_procs if "gcs_server" in cmdline(pid))
        assert b"RAY_AUTH_MODE=token" in Path(f"/proc/{gcs}/environ").read_bytes().split(b"\0")
        yield {"policy_dir": folder, "policy_url": url, "agent_url": gym.agent_url, "serve": serve, "base": base,
               "resources_url": f"http://127.0.0.1:{resources_port}"}
    finally:
        gym.stop()
        serve.kill()
        serve.wait(30)
    if sid is not None:
        assert gym.proc is None and session_pids(sid) == [], "NeMo Gym processes left behind"
        left = [cmdline(pid)[:200] for pid, start in ray_procs if identity(pid) == (pid, start)]
        assert left == [] and ray_pids(ray_dir) == [] and not ray_dir.exists(), f"NeMo Gym's Ray left behind: {left}"
