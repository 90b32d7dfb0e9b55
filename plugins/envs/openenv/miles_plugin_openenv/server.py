"""Serve the bundled ``sum_guess`` game with OpenEnv's own ``create_app`` under uvicorn.

``python -m miles_plugin_openenv.server --port 8000`` (the recipe's server; tests start it in a
subprocess). Any other OpenEnv environment server works the same way with the ``openenv`` env.
"""
from __future__ import annotations

import argparse
import errno
import socket
import sys

PROG = "python -m miles_plugin_openenv.server"


def build_app(max_concurrent_envs: int = 256, teacher_carry_accuracy: float | None = None):
    from openenv.core.env_server.http_server import create_app

    from .game import TEACHER_CARRY_ACCURACY, GuessAction, GuessObservation, SumGuessEnvironment

    acc = TEACHER_CARRY_ACCURACY if teacher_carry_accuracy is None else teacher_carry_accuracy
    # create_app builds one instance per WebSocket session from a class: the setting rides on a subclass
    game = type("SumGuessEnvironment", (SumGuessEnvironment,), {"TEACHER_CARRY_ACCURACY": acc})
    return create_app(game, GuessAction, GuessObservation, env_name="sum_guess",
                      max_concurrent_envs=max_concurrent_envs)


def bad_input(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, naming the flag and the fix; None when it is usable."""
    if not 0 < args.max_sessions:
        return f"--max-sessions {args.max_sessions}: pass a positive number of concurrent sessions"
    acc = args.teacher_carry_accuracy
    if acc is not None and not 0.0 <= acc <= 1.0:
        return f"--teacher-carry-accuracy {acc}: pass a probability in 0..1"
    if not 0 <= args.port < 65536:
        return f"--port {args.port} is not a TCP port; pass one in 1..65535 (0: any free one)"
    try:
        infos = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"--host {args.host}: cannot be resolved ({e.strerror}); pass an address of this machine, e.g. 127.0.0.1"
    with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as uvicorn sets it: only a listening socket makes the port busy, not TIME_WAIT
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(infos[0][4])
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"--port {args.port}: {args.host}:{args.port} is in use ({e.strerror}); pass a free "
                        "--port or stop what listens there")
            return f"--host {args.host}: cannot listen there ({e.strerror}); pass an address of this machine"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-sessions", type=int, default=256, help="concurrent WebSocket sessions")
    ap.add_argument("--teacher-carry-accuracy", type=float, default=None,
                    help="how often the reference answer keeps a carry (default 0.4)")
    args = ap.parse_args(argv)
    problem = bad_input(args)  # one line naming the flag (exit 2), before seconds of importing openenv
    if problem:
        ap.exit(2, f"{PROG}: error: {problem}\n")
    import uvicorn

    uvicorn.run(build_app(args.max_sessions, args.teacher_carry_accuracy), host=args.host, port=args.port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
