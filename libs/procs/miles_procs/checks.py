"""Checks of a launcher's command-line input, before anything slow (a venv build, a server) starts.
Each failure is a ``MilesError`` (exit 2) whose message names the flag and the fix, so a launcher
prints it as one line, as ``miles`` does, instead of a traceback."""
from __future__ import annotations

import os
import random
import socket
from typing import Any
from pathlib import Path

from miles import MilesError

__all__ = ["api_key", "distinct_ports", "free_port", "listening_socket", "port_free", "unused_port", "work_folder"]

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


def unused_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now, for a server to bind a moment later; never the
    same twice in this process, so servers started together (before any of them binds) each get
    their own. It is taken between Ray's worker ports (10002-19999) and the kernel's ephemeral
    range where it can: a port from that range (what binding port 0 gives) may go to one of the
    outgoing connections of a busy host before the server binds it."""
    low = _ephemeral_low()
    for _ in range(100 if low > 20_001 else 0):
        port = random.randint(20_000, low - 1)
        if port not in _GIVEN and port_free(host, port):
            _GIVEN.add(port)
            return port
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def port_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (a port in TIME_WAIT counts as free, as servers
    set SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the port-0 fallback
        return 0


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


def api_key(args: Any) -> str | None:
    """A server command's key: ``--api-key``, else ``--api-key-file``, else ``$MILES_API_KEY`` (a
    file or the environment keeps it out of ``ps``). It travels in an HTTP header, so a blank key
    (every request would get a 401) or one with spaces or control characters is refused."""
    if args.api_key is not None:
        key = args.api_key
    elif args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise MilesError(f"--api-key-file {args.api_key_file}: cannot read it ({e.strerror})") from None
        if not key:
            raise MilesError(f"--api-key-file {args.api_key_file} is empty; write the key into it")
    else:
        return os.environ.get("MILES_API_KEY", "").strip() or None
    if not key.strip():
        raise MilesError("--api-key is blank: give a non-empty key (or leave --api-key out on 127.0.0.1)")
    if key != key.strip() or not all(33 <= ord(c) < 127 for c in key):
        raise MilesError("--api-key: use printable ASCII without spaces (it travels in an HTTP header)")
    return key


def listening_socket(host: str, port: int, backlog: int = 64) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (IPv6 for a host with ':'), or a
    ``MilesError`` naming the port. proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on accepted
    sockets of that proto, and without it a response written in two pieces waits for a delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MilesError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); pass another "
                         f"--port (0 picks a free one)") from None
    sock.listen(backlog)
    return sock
