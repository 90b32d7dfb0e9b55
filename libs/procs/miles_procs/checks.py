"""Checks of a launcher's command-line input, before anything slow (a venv build, a server) starts.
Each failure is a ``MilesError`` (exit 2) whose message names the flag and the fix, so a launcher
prints it as one line, as ``miles`` does, instead of a traceback."""
from __future__ import annotations

import socket
from pathlib import Path

from miles import MilesError

__all__ = ["distinct_ports", "free_port", "unused_port", "work_folder"]

_GIVEN: set[int] = set()


def free_port(flag: str, port: int) -> int:
    """``port`` when it is a TCP port and nothing listens on it at 127.0.0.1, else an error naming ``flag``."""
    if not 0 < port < 65536:
        raise MilesError(f"{flag} {port} is not a TCP port; pass one in 1..65535")
    with socket.socket() as s:
        # SO_REUSEADDR as servers set it: only a listening socket makes the port busy, not TIME_WAIT
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise MilesError(f"{flag} {port}: 127.0.0.1:{port} is in use ({e.strerror}); pass a free {flag} "
                             "or stop what listens there") from None
    return port


def unused_port() -> int:
    """A port nothing listens on at 127.0.0.1, never the same twice in this process: servers started
    together (before any of them binds) each get their own."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def distinct_ports(ports: dict[str, int]) -> None:
    """An error naming the first two flags of ``ports`` (flag -> port) that give the same port:
    two servers of one launcher cannot both listen there."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port in seen:
            raise MilesError(f"{seen[port]} and {flag} are both {port}; give them different ports")
        seen[port] = flag


def work_folder(path: str, flag: str = "--work-dir") -> Path:
    """``path`` resolved and created; an error naming ``flag`` when it is a file or cannot be created."""
    folder = Path(path).resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MilesError(f"{flag} {path}: cannot create the folder ({e.strerror}); pass a folder path "
                         "you can write to") from None
    return folder
