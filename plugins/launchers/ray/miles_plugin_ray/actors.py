"""The Ray actors of a run. Each owns one child process (``miles serve`` or ``miles train``).

A child runs in its own session, so signals reach it only on purpose, and is started from the
actor's keeper thread with ``PR_SET_PDEATHSIG``: if the actor process dies (killed, node lost),
the kernel kills its child too, and nothing of the run is left behind.
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import ray
from miles_procs import port_free, unused_port


def _await_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not port_free(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def describe_exit(rc: int) -> str:
    return f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"


def log_tail(path: Path | None, lines: int = 15) -> str:
    if path is None:
        return ""
    try:
        rows = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"; its log is {path}" + (("; last lines:\n    " + "\n    ".join(rows)) if rows else "")


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the thread that started it exits."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the actor's stop() still ends the child
        pass


class Child:
    """One supervised process, started and (re)started only by ``Keeper``'s thread."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None, log: Path | None,
                 stream: bool):
        self.argv, self.env, self.cwd, self.log, self.stream = argv, env, cwd, log, stream
        self.proc: subprocess.Popen | None = None
        # Lines stay until the driver acknowledges them: a status reply lost in transit
        # (an actor Ray briefly reports unavailable) must not lose console lines.
        self.output: collections.deque = collections.deque(maxlen=100_000)
        self.read_upto = 0  # index of the first line still in ``output``
        self.lock = threading.Lock()

    def spawn(self) -> None:
        if self.stream:  # the driver prints this child's lines as its console
            out = err = subprocess.PIPE
        else:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log, "ab")  # noqa: SIM115 (the child holds it; closed below)
            err = subprocess.STDOUT
        base = dict(os.environ)
        base.pop("OMP_NUM_THREADS", None)  # Ray's one-thread default for actors: the launcher sets it if asked
        self.proc = subprocess.Popen(self.argv, env={**base, **self.env}, cwd=self.cwd,
                                     stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        if self.stream:
            for pipe, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
                threading.Thread(target=self._pump, args=(pipe, name), daemon=True).start()
        else:
            out.close()

    def _pump(self, pipe: Any, name: str) -> None:
        for line in iter(pipe.readline, b""):
            with self.lock:
                if len(self.output) == self.output.maxlen:
                    self.read_upto += 1  # the oldest line falls out
                self.output.append((name, line.decode(errors="replace")))
        pipe.close()

    def lines_since(self, seen: int) -> tuple[list[tuple[str, str]], int]:
        """Lines from index ``seen`` on (dropping the ones before it: acknowledged) and the next index."""
        with self.lock:
            while self.read_upto < seen and self.output:
                self.output.popleft()
                self.read_upto += 1
            return list(self.output), self.read_upto + len(self.output)

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError, AttributeError):
            pass


class Keeper:
    """Starts a child from one long-lived thread (the parent that ``PR_SET_PDEATHSIG`` watches),
    restarts it up to ``max_restarts`` times when it dies, and records why it stopped."""

    def __init__(self, name: str, child: Child, max_restarts: int, restart_on_success: bool):
        self.name, self.child, self.max_restarts = name, child, max_restarts
        self.restart_on_success = restart_on_success
        self.restarts, self.rc, self.stopping = 0, None, False
        self.events: list[str] = []  # append-only: the driver reads them by index
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"  # a restarted actor starts over
        self.lock = threading.Lock()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        self.child.spawn()
        started.set()
        while True:
            rc = self.child.proc.wait()
            with self.lock:
                if self.stopping or (rc == 0 and not self.restart_on_success) \
                        or self.restarts >= self.max_restarts:
                    self.rc = rc
                    break
                self.restarts += 1
                self.events.append(f"{self.where(rc)}; restarting it ({self.restarts}/{self.max_restarts})")
                self.child.signal_group(signal.SIGKILL)  # anything it left behind
                self.child.spawn()
        while not self.stopping:  # the child's death signal fires when this thread exits
            time.sleep(0.5)

    def where(self, rc: int) -> str:
        return (f"{self.name} (pid {self.child.proc.pid} on {ray.util.get_node_ip_address()}) "
                f"{describe_exit(rc)}")

    def status(self, incarnation: str = "", events_seen: int = 0, output_seen: int = 0) -> dict[str, Any]:
        """What happened since the driver's last acknowledged read of this incarnation."""
        if incarnation != self.incarnation:
            events_seen = output_seen = 0
        with self.lock:
            events, rc = self.events[events_seen:], self.rc
            events_end = len(self.events)
        output, output_end = self.child.lines_since(output_seen)
        out = {"rc": rc, "events": events, "output": output, "restarts": self.restarts,
               "cursor": (self.incarnation, events_end, output_end)}
        if rc is not None:
            out["error"] = self.where(rc) + log_tail(self.child.log)
        return out

    def stop(self, grace: float) -> int | None:
        """SIGTERM the child's group, SIGKILL it after ``grace`` seconds; its exit code."""
        with self.lock:
            self.stopping = True
        proc = self.child.proc
        self.child.signal_group(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self.child.signal_group(signal.SIGKILL)  # grandchildren too, even if the leader exited
        return proc.wait()


@ray.remote(max_concurrency=4)
class TrainerActor:
    """Trainer rank ``rank``: ``miles train`` as a child with torchrun-style env."""

    def __init__(self, rank: int, log_dir: str):
        self.rank, self.log_dir, self.keeper = rank, Path(log_dir), None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0 is the process-group master)."""
        return ray.util.get_node_ip_address(), unused_port("")

    def start(self, config_text: str, config_path: str, env: dict[str, str], cwd: str,
              urls: list[str] | None = None, urls_file: str | None = None) -> int:
        path = Path(config_path)
        _write_atomic(path, config_text)
        if urls_file:
            self.engine_urls(urls or [], urls_file)
        argv = [sys.executable, "-m", "miles.cli", "train", str(path)]
        log = None if self.rank == 0 else self.log_dir / f"trainer-{self.rank}.log"
        child = Child(argv, env, cwd if os.path.isdir(cwd) else None, log, stream=self.rank == 0)
        self.keeper = Keeper(f"trainer rank {self.rank}", child, 0, restart_on_success=False)
        return child.proc.pid

    def engine_urls(self, urls: list[str], urls_file: str) -> None:
        """Tell this rank's engine client where the engines are now (one moved on a restart)."""
        _write_atomic(Path(urls_file), json.dumps(urls))

    def status(self, *cursor: Any) -> dict[str, Any]:
        return self.keeper.status(*cursor)

    def interrupt(self) -> None:
        """SIGTERM: the trainer finishes its step, checkpoints and exits."""
        self.keeper.child.signal_group(signal.SIGTERM)

    def stop(self, grace: float) -> int | None:
        return self.keeper.stop(grace) if self.keeper else None


@ray.remote(max_concurrency=4)
class EngineActor:
    """Engine ``index``: a ``miles serve`` child on this node, restarted on the same port when it
    dies, so the trainer's engine client finds it again at the URL it knows."""

    def __init__(self, index: int, model_dir: str, model_files: list, serve_args: list[str],
                 port: int, env: dict[str, str], cwd: str, log_dir: str, max_restarts: int, api_key: str):
        host = ray.util.get_node_ip_address()
        if not (Path(model_dir) / "config.json").is_file():  # another node: unpack the shipped copy
            model_dir = _unpack(ray.get(model_files[0]), index)
        if not _await_port(host, port, timeout=10.0):  # a restarted actor's old server may still hold it
            port = unused_port(host)
        self.url, self.api_key = f"http://{host}:{port}", api_key
        # bound to the node's address (other nodes' trainers reach it), so it requires the run's key
        child = Child(serve_argv(model_dir, host, port, api_key, serve_args), env, cwd if os.path.isdir(cwd) else None,
                      Path(log_dir) / f"engine-{index}.log", stream=False)
        self.keeper = Keeper(f"engine {index}", child, max_restarts, restart_on_success=True)

    def address(self) -> str:
        return self.url

    def healthy(self) -> bool:
        try:
            req = urllib.request.Request(f"{self.url}/health",
                                         headers={"Authorization": f"Bearer {self.api_key}"})
            with urllib.request.urlopen(req, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def status(self, *cursor: Any) -> dict[str, Any]:
        return self.keeper.status(*cursor)

    def stop(self, grace: float) -> int | None:
        return self.keeper.stop(grace)


def serve_argv(model_dir: str, host: str, port: int, api_key: str, serve_args: list[str]) -> list[str]:
    """The engine's ``miles serve`` command; ``--api-key=KEY`` in one word, since a key that begins
    with '-' would otherwise read as an option."""
    return [sys.executable, "-m", "miles.cli", "serve", model_dir, "--port", str(port), "--host", host,
            f"--api-key={api_key}", *serve_args]


def _write_atomic(path: Path, text: str) -> None:
    """Ranks on one node may write the same file at once, and readers must never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(text)
    os.replace(f.name, path)


def _unpack(files: dict[str, bytes], index: int) -> str:
    root = Path(tempfile.mkdtemp(prefix=f"miles-engine-{index}-model-"))
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return str(root)
