"""The Ray launcher end to end: trainer ranks and engine servers as Ray actors, on a local Ray
instance the run starts (and stops), with Ray's temp dir and HOME in a folder of the test.

Each test starts a real run (`miles train` with `launcher.name: ray`) on a tiny config and checks
its outcome, the Ray actors it ran, and that no process of the run or of its Ray instance is left.
"""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from miles_procs import unused_port

ROOT = Path(__file__).resolve().parents[4]
TINY = str(ROOT / "tests" / "tiny.yaml")


@pytest.fixture
def ray_home():
    """A short folder (Ray's socket paths have a length limit) for Ray's temp dir and HOME."""
    home = Path(tempfile.mkdtemp(prefix="mray", dir="/tmp"))
    # without the suite's own thread setting, so that a server's OMP_NUM_THREADS=1 can only be Ray's
    inherited = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env = {**inherited, "HOME": str(home), "RAY_TMPDIR": str(home / "r"), "RAY_AUTH_MODE": "disabled"}
    yield home, env
    shutil.rmtree(home, ignore_errors=True)


def rows(out):
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def processes(*needles) -> list[tuple[int, str]]:
    """(pid, cmdline) of every live process whose command line mentions one of ``needles``."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (d / "stat").read_text().split()[2]
            except OSError:
                continue
            if any(str(n) in cmd for n in needles) and state != "Z":
                found.append((int(d.name), cmd))
    return found


def nothing_left(*needles, timeout=20.0) -> list:
    deadline = time.time() + timeout
    while (left := processes(*needles)) and time.time() < deadline:
        time.sleep(0.2)
    return left


def launch(out, env, *overrides):
    cmd = [sys.executable, "-m", "miles.cli", "train", TINY, f"run.out_dir={out}", "launcher.name=ray",
           "launcher.num_cpus=2", "run.warm_start.max_steps=5", *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # Read both pipes as a terminal would: a full pipe would block the driver's prints (and its
    # supervision with them) while the run's actors go on without it.
    proc.lines = {"stdout": [], "stderr": []}
    proc.readers = [threading.Thread(target=_drain, args=(getattr(proc, name), proc.lines[name]), daemon=True)
                    for name in proc.lines]
    for reader in proc.readers:
        reader.start()
    return proc


def _drain(pipe, into: list) -> None:
    for line in iter(pipe.readline, ""):
        into.append(line)
    pipe.close()


def printed(proc, stream="stderr") -> str:
    return "".join(list(proc.lines[stream]))


def finish(proc, timeout=400):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the run did not end within {timeout} s; its stderr:\n{printed(proc)[-4000:]}") from None
    finally:
        proc.kill()
        for reader in proc.readers:
            reader.join(timeout=30)
    return proc.returncode, printed(proc, "stdout"), printed(proc)


def wait_for(pred, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            for reader in proc.readers:
                reader.join(timeout=30)
            raise AssertionError(f"the run ended (exit {proc.returncode}); its stderr:\n{printed(proc)[-3000:]}")
        time.sleep(0.05)
    raise AssertionError("timed out")


def list_actors(out, env) -> subprocess.Popen:
    """Ray's own CLI, `ray list actors`, at the address the run recorded (never "auto", which may
    find another Ray instance on this machine), in the background: its JSON rows on stdout."""
    info = json.loads((out / "launch" / "ray.json").read_text())
    assert info["dashboard"], info
    ray = str(Path(sys.executable).with_name("ray"))
    env = {k: v for k, v in env.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    return subprocess.Popen([ray, "list", "actors", "--address", info["dashboard"], "--format", "json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_role_named_actors_and_engine_server_then_actor_killed_every_step_runs_once(tmp_path, ray_home):
    home, env = ray_home
    out = tmp_path / "run"
    proc = launch(out, env, "run.steps=30", "sync.name=tensor", "sync.verify=true")

    def engine_server(timeout=60.0):
        """The one live ``miles serve`` of the run (waiting while a restart brings it back)."""
        deadline = time.time() + timeout
        while len(found := [pid for pid, cmd in processes(out) if " serve " in cmd]) != 1 and time.time() < deadline:
            time.sleep(0.2)
        assert len(found) == 1, found
        return found[0]

    wait_for(lambda: len(rows(out)) >= 3, proc)
    lister = list_actors(out, env)  # every actor of the run exists now
    time.sleep(random.uniform(0.0, 0.5))  # a random moment: mid-rollout, mid-push or between them
    killed = engine_server()
    os.kill(killed, signal.SIGKILL)  # the actor restarts its server on the same port
    wait_for(lambda: not alive(killed), proc)
    wait_for(lambda: len(rows(out)) >= 7, proc)
    first_kill = f"(pid {killed} on "
    wait_for(lambda: first_kill in printed(proc), proc, timeout=60)  # reported before the actor dies too
    assert engine_server() != killed  # a new server, started by the same actor (checked below)
    status = Path(f"/proc/{engine_server()}/status").read_text()
    actor = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    assert "EngineActor" in Path(f"/proc/{actor}/cmdline").read_text(errors="replace")
    environ = Path(f"/proc/{engine_server()}/environ").read_bytes().split(b"\0")
    assert b"OMP_NUM_THREADS=1" not in environ  # torch's own thread count, as under the local launcher
    argv = Path(f"/proc/{engine_server()}/cmdline").read_bytes().decode().split("\0")
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    os.kill(actor, signal.SIGKILL)  # Ray restarts the actor; its server died with it
    # Take the freed port before the restarted actor does: it then serves on another port, as
    # after a move to another node, and the trainer's engine client must follow it there.
    holder, deadline = socket.socket(), time.time() + 10
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # its old connections linger in TIME_WAIT
    while True:
        try:
            holder.bind((host, port))
            break
        except OSError:
            assert time.time() < deadline, "the engine's server outlived its actor"
            time.sleep(0.005)
    holder.listen()
    try:
        rc, stdout, err = finish(proc)
    finally:
        holder.close()
    assert rc == 0, err[-3000:]
    listed, lister_err = lister.communicate(timeout=300)
    assert lister.returncode == 0, lister_err[-3000:]
    actors = {a["name"]: a["class_name"] for a in json.loads(listed)}  # alive or restarting when asked
    assert actors == {"miles-engine-0": "EngineActor", "miles-trainer-0": "TrainerActor"}, listed[-2000:]
    launcher = "\n".join(line for line in err.splitlines() if line.startswith("miles"))  # its lines only
    info = json.loads((out / "launch" / "ray.json").read_text())
    assert f"miles: Ray at {info['address']} (namespace {info['namespace']}); dashboard {info['dashboard']}; " \
           f"its actors: ray list actors --address {info['dashboard']}" in err, launcher
    first_kill = f"(pid {killed} on {host}) was killed by SIGKILL; restarting it (1/3) (actor miles-engine-0)"
    assert first_kill in err, launcher
    assert "actor miles-engine-0 died; Ray restarted it" in err, launcher
    assert f"miles: engine 0 moved from http://{host}:{port} to http://{host}:" in err, launcher
    assert f"miles sglang: http://{host}:{port} moved to http://{host}:" in err, launcher
    got = rows(out)
    assert [r["step"] for r in got] == list(range(31))  # every step once
    for r in got[1:]:  # every step trained on the groups it asked for, none twice
        assert r["groups_kept"] + r["groups_dropped"] == 8
    assert "step 30/30" in stdout and "done: 30 steps" in stdout  # rank 0's console, via the driver
    assert "listening on" in (out / "logs" / "engine-0.log").read_text()
    assert nothing_left(out, home) == []  # the run's children and the Ray instance it started


def test_dead_trainer_is_named_rerun_resumes_and_sigint_checkpoints(tmp_path, ray_home):
    home, env = ray_home
    out = tmp_path / "run"
    proc = launch(out, env, "run.steps=200", "launcher.dashboard=false")  # no dashboard: a lighter start
    wait_for(lambda: len(rows(out)) >= 4, proc)  # tiny.yaml checkpoints every 2 steps
    trainers = [pid for pid, cmd in processes(out) if " train " in cmd and "trainer.yaml" in cmd]
    assert len(trainers) == 1
    os.kill(trainers[0], signal.SIGKILL)
    rc, _, err = finish(proc)
    assert rc == 2, err[-3000:]
    info = json.loads((out / "launch" / "ray.json").read_text())
    assert info["dashboard"] is None and f"miles: Ray at {info['address']} (namespace " in err
    assert f"miles: error: trainer rank 0 (pid {trainers[0]} on " in err
    assert "was killed by SIGKILL (actor miles-trainer-0); rerun the same command to resume" in err
    assert nothing_left(out, home) == []
    # a kill during a checkpoint leaves its temp folder (the rerun removes it): sealed ones only
    saved = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    logged = rows(out)[-1]["step"]  # the killed run may have logged past its last checkpoint
    proc = launch(out, env, "run.steps=200", "run.checkpoint_every=1000", "launcher.dashboard=false")
    # steps the rerun made itself (the old rows are there until it truncates them at start-up)
    wait_for(lambda: rows(out) and rows(out)[-1]["step"] >= logged + 2, proc)
    proc.send_signal(signal.SIGINT)
    rc, stdout, err = finish(proc, timeout=120)
    assert rc == 130, err[-3000:]
    assert f"resuming from step {saved}" in stdout
    assert "SIGINT: trainers checkpointed and stopped; rerun the same command to resume" in err
    last = rows(out)[-1]["step"]
    assert last > saved and (out / "checkpoints" / f"step_{last:06d}").is_dir()
    assert [r["step"] for r in rows(out)] == list(range(last + 1))  # every step once across the runs
    assert nothing_left(out, home) == []


def test_config_errors_name_the_keys(tmp_path, ray_home):
    _, env = ray_home
    r = subprocess.run([sys.executable, "-m", "miles.cli", "train", TINY, f"run.out_dir={tmp_path}",
                        "launcher.name=ray", "launcher.placement=diagonal", "launcher.trainer_ranks=0",
                        "launcher.resources.engine.CPU=-1", "launcher.adress=auto"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    for key in ("launcher.placement", "launcher.trainer_ranks", "launcher.resources.engine", "launcher.adress"):
        assert f"  - {key}:" in r.stderr, r.stderr[-2000:]


def test_engine_command_takes_a_key_that_begins_with_a_dash(tmp_path):
    from miles_plugin_ray.actors import serve_argv

    missing = tmp_path / "no_model"  # `miles serve` reads its arguments, then stops at the folder
    r = subprocess.run(serve_argv(str(missing), "127.0.0.1", 1, "-Kx_1", []), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and str(missing) in r.stderr, r.stderr[-2000:]


def ray_cli(env, *args):
    ray = str(Path(sys.executable).with_name("ray"))
    r = subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def stop_cluster(home) -> None:
    """Stop the Ray processes of this test's cluster (they name its temp dir), by pid; some of them
    outlast a SIGTERM by many seconds, so the SIGKILL follows soon."""
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 10)):
        for pid, _ in processes(home):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not nothing_left(home, timeout=grace):
            return


def parent(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def parent_or_none(pid: int) -> int | None:
    try:
        return parent(pid)
    except (OSError, StopIteration):
        return None


@pytest.mark.slow
def test_cluster_trainer_on_one_node_engine_on_another_survives_losing_the_engine_node(tmp_path, ray_home):
    home, env = ray_home
    # Ray's control service declares a node dead after this many failed health checks, this far
    # apart (5 checks 3 s apart by default): the lost node is noticed in about 3 s instead of 15
    env = {**env, "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    port = str(unused_port())
    out = tmp_path / "run"
    try:
        # three "nodes" on this machine, told apart by custom resources: the trainer's and two that
        # can hold the engine, so the engine has somewhere to go when its node is lost
        ray_cli(env, "start", "--head", f"--port={port}", "--num-cpus=1", '--resources={"node_a": 1}',
                "--include-dashboard=false", f"--temp-dir={home / 'r'}")
        for _ in range(2):
            ray_cli(env, "start", f"--address=127.0.0.1:{port}", "--num-cpus=1", '--resources={"node_b": 1}')
        proc = launch(out, env, "run.steps=20", f"launcher.address=127.0.0.1:{port}",
                      "launcher.placement=disaggregated", "launcher.resources.trainer={CPU: 1, node_a: 1}",
                      "launcher.resources.engine={CPU: 1, node_b: 1}", "sync.name=tensor", "sync.verify=true")
        wait_for(lambda: len(rows(out)) >= 3, proc)
        server = next(pid for pid, cmd in processes(out) if " serve " in cmd)
        raylet = parent(parent(server))  # server -> engine actor's worker -> its node's raylet
        assert "raylet" in Path(f"/proc/{raylet}/cmdline").read_text(errors="replace")
        # the engine's node is lost: its raylet and every worker it started (the engine actor's among them)
        workers = [pid for pid, _ in processes("") if pid != raylet and parent_or_none(pid) == raylet]
        for pid in [raylet, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda: not alive(server), proc)  # its server goes with it
        assert len(rows(out)) < 21  # while the run still has steps to make
        rc, stdout, err = finish(proc)
        assert rc == 0, err[-3000:]
        assert [r["step"] for r in rows(out)] == list(range(21))  # every step once
        assert "actor miles-engine-0 died; Ray restarted it" in err, err[-3000:]
        assert nothing_left(out) == []  # the run's children; the cluster stays up for its owner
        assert processes(home)
    finally:
        stop_cluster(home)
    assert processes(home) == []
