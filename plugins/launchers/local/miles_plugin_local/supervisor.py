"""Child processes of one run: start, watch, stop. No child outlives the supervisor.

Every child runs in its own session (process group), so a terminal's Ctrl-C reaches only the
launcher, which then stops the children in order (trainers first, so they can checkpoint) and
kills whatever is left, grandchildren included.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from miles import MilesError


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path | None
    role: str  # "trainer" | "engine"
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    done: bool = False
    handle: IO | None = field(default=None, repr=False)

    def describe(self, rc: int) -> str:
        how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
        text = f"{self.name} (pid {self.proc.pid}) {how}"
        if self.log is not None:
            text += f"; its log is {self.log}" + _tail(self.log)
        return text


def _tail(path: Path, lines: int = 15) -> str:
    try:
        rows = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return ("; last lines:\n    " + "\n    ".join(rows)) if rows else ""


class Supervisor:
    def __init__(self, log_dir: Path, max_restarts: int = 0):
        self.log_dir = log_dir
        self.max_restarts = max_restarts  # per engine; trainers are never restarted (resume instead)
        self.children: list[Child] = []
        self.stop_signal: int | None = None

    def start(self, name: str, role: str, argv: list[str], env: dict[str, str], log: str | None) -> Child:
        """Start a child; ``log`` None means it shares the launcher's stdout/stderr."""
        path = handle = None
        if log is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            path = self.log_dir / log
            handle = open(path, "ab")  # noqa: SIM115 (closed in stop_all)
        child = Child(name, _spawn(argv, env, handle), path, role, argv, env, handle=handle)
        self.children.append(child)
        return child

    def restart(self, c: Child, rc: int) -> None:
        c.restarts += 1
        print(f"miles: {c.describe(rc).split('; its log')[0]}; restarting it "
              f"({c.restarts}/{self.max_restarts})", file=sys.stderr, flush=True)
        _signal_group(c.proc, signal.SIGKILL)  # anything it left behind
        c.proc = _spawn(c.argv, c.env, c.handle)

    def failure(self) -> str | None:
        """A message for the first child that failed (an engine that exits at all has failed)."""
        for c in self.children:
            rc = c.proc.poll()
            if rc is None or c.done:
                continue
            if c.role == "trainer" and rc == 0:
                c.done = True
                continue
            if c.role == "engine" and c.restarts < self.max_restarts:
                self.restart(c, rc)
                continue
            if c.role == "engine" and c.restarts:
                return f"{c.describe(rc)}; it failed {c.restarts + 1} times (launcher.max_engine_restarts)"
            return c.describe(rc)
        return None

    def wait_healthy(self, urls: list[str], timeout: float) -> None:
        """Block until every engine answers ``GET /health``; fail fast if one dies."""
        deadline = time.monotonic() + timeout
        pending = list(urls)
        while pending:
            self.check()
            pending = [u for u in pending if not _healthy(u)]
            if pending and time.monotonic() > deadline:
                raise MilesError(f"engine(s) at {', '.join(pending)} did not become healthy within "
                                 f"{timeout:.0f} s (launcher.startup_timeout_s); see {self.log_dir}")
            if pending:
                time.sleep(0.2)

    def check(self) -> None:
        if self.stop_signal is not None:
            raise KeyboardInterrupt
        msg = self.failure()
        if msg:
            raise MilesError(msg)

    def supervise(self) -> None:
        """Return when every trainer rank has exited 0; raise on the first failure."""
        trainers = [c for c in self.children if c.role == "trainer"]
        while not all(c.done for c in trainers):
            self.check()
            time.sleep(0.1)

    def interrupt_trainers(self, grace: float) -> bool:
        """Forward SIGTERM to trainer ranks (they checkpoint and exit); True if all exited in time."""
        trainers = [c for c in self.children if c.role == "trainer" and c.proc.poll() is None]
        for c in trainers:
            _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(c.proc.poll() is None for c in trainers) and time.monotonic() < deadline:
            time.sleep(0.1)
        return all(c.proc.poll() is not None for c in trainers)

    def stop_all(self, grace: float = 10.0) -> None:
        """SIGTERM every live child's process group, then SIGKILL what is left after ``grace``."""
        live = [c for c in self.children if c.proc.poll() is None]
        for c in live:
            _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(c.proc.poll() is None for c in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        for c in self.children:
            _signal_group(c.proc, signal.SIGKILL)  # grandchildren too, even if the leader exited
            if c.proc.poll() is None:
                c.proc.wait()
            if c.handle is not None:
                c.handle.close()


def _spawn(argv: list[str], env: dict[str, str], handle: IO | None) -> subprocess.Popen:
    return subprocess.Popen(argv, env={**os.environ, **env}, stdout=handle, stderr=handle,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
