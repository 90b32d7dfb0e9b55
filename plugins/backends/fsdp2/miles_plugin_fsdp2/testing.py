"""Test helpers: run N torchrun-style ranks on this machine.

Every rank gets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT``. If a rank fails or the time runs out, every rank still alive is killed (a rank
stuck in a collective would otherwise wait forever), also when the caller is interrupted.

:func:`launch` runs a script as fresh interpreters, as torchrun does. Forking the caller instead
would save the imports, but a forked test worker that already runs threads can crash.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence


def free_port() -> int:
    """A TCP port free right now on localhost (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def launch(argv: Sequence[str], world_size: int, timeout: float = 120.0,
           env: dict[str, str] | None = None, cwd: str | None = None) -> list[str]:
    """Run ``python *argv`` as ``world_size`` ranks; return each rank's output (stdout + stderr).
    Raises ``RuntimeError`` (with every rank's output tail) when a rank exits non-zero or
    ``timeout`` seconds pass."""
    port = free_port()
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(world_size)]
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world_size):
            e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), **rank_env(rank, world_size, port)}
            procs.append(subprocess.Popen([sys.executable, *argv], env=e, cwd=cwd, stdout=logs[rank],
                                          stderr=subprocess.STDOUT))
        _supervise([p.poll for p in procs], timeout, lambda: _tails(logs))
        return [_read(f) for f in logs]
    finally:
        for p in procs:  # only the processes started here, by their handles
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()


def leave_rank(code: int = 0) -> None:
    """End a rank script before interpreter teardown. A sharded model's gloo worker threads outlive
    ``destroy_process_group``; one that releases tensors during teardown aborts the process
    (SIGABRT after the results were written), as ``miles train`` ranks avoid the same way."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _supervise(polls: list[Callable[[], int | None]], timeout: float, detail: Callable[[], str]) -> None:
    """Wait until every rank exited 0; raise at the first failure or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [poll() for poll in polls]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            raise RuntimeError(f"rank {bad[0]} exited with {codes[bad[0]]}\n{detail()}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks still running after {timeout:.0f} s\n{detail()}")
        time.sleep(0.05)


def _read(f) -> str:
    f.seek(0)
    return f.read()


def _tails(logs, chars: int = 3000) -> str:
    return "\n".join(f"--- rank {r} ---\n{_read(f)[-chars:]}" for r, f in enumerate(logs))
