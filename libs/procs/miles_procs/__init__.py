"""The processes of a server started in its own session (``start_new_session=True``), and
stopping all of them: what the server started in turn (daemons, containers' tools) is in that
session too, so nothing of it outlives the stop. Also the launcher's loop around such a server,
and (``checks``) the checks of a launcher's command-line input."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from miles import MilesError  # public error type: a launcher prints it as one line, no traceback

from .checks import api_key, distinct_ports, free_port, listening_socket, port_free, unused_port, work_folder

__all__ = ["ServerExited", "api_key", "default_sigint", "distinct_ports", "free_port", "kill_until_gone",
           "listening_socket", "port_free",
           "serve_until_stopped", "session_pids", "stop_session", "unused_port", "venv_from_script", "work_folder"]


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, session
            out.append(int(stat.parent.name))
    return out


def stop_session(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGINT the session leader ``proc`` (it stops its own children cleanly if it can), wait up
    to ``grace_s``, then SIGKILL whatever is left in its session."""
    sid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    kill_until_gone(lambda: session_pids(sid), rounds=2)
    if proc.poll() is None:
        proc.wait(5)


def kill_until_gone(find: Callable[[], list[int]], rounds: int = 3) -> None:
    """SIGKILL the processes ``find()`` lists, again while it still lists some (a daemon may fork
    once more while the first kills land), at most ``rounds`` times."""
    for _ in range(rounds):
        pids = find()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not pids:
            break
        time.sleep(0.5)


def default_sigint() -> None:
    """A server's ``preexec_fn``: SIGINT back to its default in the child. A shell's background job
    inherits SIGINT ignored, and a server stops its own children cleanly only on a SIGINT it receives."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


class ServerExited(MilesError):
    """The server a launcher watches exited without being asked to; the message is one line naming
    it, how it ended and its log. Exit code 1: the input was fine, the server failed."""

    exit_code = 1

    def __init__(self, name: str, code: int, log: Path | str | None = None) -> None:
        self.name, self.code, self.log = name, code, log
        if code < 0:  # Popen's returncode for a death by signal (the OOM killer's SIGKILL, a segfault)
            try:
                how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited on its own with code {code}"
        super().__init__(f"{name} {how}" + (f"; its log: {log}" if log else ""))


def serve_until_stopped(start: Callable[[], str], poll: Callable[[], int | None], stop: Callable[[], None],
                        name: str, log: Path | str | None = None) -> None:
    """A launcher's foreground loop: ``start()`` (it returns the line to print once the server is
    up), then wait while ``poll()`` (the server's ``Popen.poll``) is None. Ctrl-C and ``kill``
    (SIGTERM, which also reaches a background job, where SIGINT is ignored) end the wait and
    return normally; ``stop()`` then runs with both signals ignored, so a second one cannot cut it
    short and leave the server's children behind. A server that exits by itself (any code: a
    server is meant to run until stopped) is stopped all the same, for what it left in its
    session, then raises ``ServerExited`` naming ``name``, its exit code and ``log``."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    code = None
    try:
        print(start(), flush=True)
        while (code := poll()) is None:
            time.sleep(1.0)
    except KeyboardInterrupt:
        code = None  # the launcher was asked to stop: whatever the server does next is that stop
    finally:
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            stop()
        finally:
            signal.signal(signal.SIGINT, sigint)
            signal.signal(signal.SIGTERM, previous)
    if code is not None:
        raise ServerExited(name, code, log)


def wait_until_ready(proc: subprocess.Popen, ready: Callable[[], bool], stop: Callable[[], None],
                     name: str, log: Path, timeout_s: float, poll_s: float = 0.5) -> None:
    """Wait until ``ready()``; a server that exits first, or is not ready within ``timeout_s``, is
    stopped and raises a ``MilesError`` naming ``name``, why, and the last lines of its ``log``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        code = proc.poll()
        if code is not None or time.monotonic() > deadline:
            tail = log.read_text()[-3000:]
            stop()
            why = f"exited with code {code}" if code is not None else f"did not come up in {timeout_s:.0f}s"
            raise MilesError(f"{name} {why} (log {log}); its last lines:\n{tail}")
        time.sleep(poll_s)


def venv_from_script(script: Path, timeout_s: float = 1800) -> Path:
    """The virtualenv a ``make_venv.sh`` builds (once; cached) and names on its last line of stdout."""
    try:
        p = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise MilesError(f"{script} did not finish in {timeout_s:.0f}s") from None
    if p.returncode != 0:
        raise MilesError(f"{script} failed (exit {p.returncode}): {p.stderr[-1500:]}")
    return Path(p.stdout.strip().splitlines()[-1])
