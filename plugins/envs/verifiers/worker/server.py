"""The verifiers worker: a verifiers environment behind a small HTTP API for miles' connector.

Runs in verifiers' own virtualenv (``scripts/make_venv.sh``), never in miles' environment:

    $(plugins/envs/verifiers/scripts/make_venv.sh) plugins/envs/verifiers/worker/server.py --port 8100

It loads a ``SingleAgentEnv`` over a verifiers taskset (``--taskset``, default the bundled
``vf_arith``) on the local subprocess runtime, holds ``env.serving()`` (verifiers' interception
server) for its lifetime, and answers:

* ``GET /health`` -> ``{"ok": true, "taskset": ..., "size": N}``
* ``POST /tasks {"start": i, "count": n}`` -> ``{"tasks": [{"idx", "id", "prompt"}, ...]}``
* ``POST /rollout {"policy_url", "episodes": [{"idx": i}, ...], "sampling": {...}, "timeout_s"}``
  -> ``{"episodes": [...]}``: each task's episode run by ``env.run_episode`` against the policy's
  OpenAI-compatible server, scored by the task's rewards, with the policy's token-level reply
  (``prompt_ids``, ``completion_ids``, ``logprobs``, ``weight_version``, ``finish_reason``) or an
  ``error``.
"""
from __future__ import annotations

import argparse
import errno
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bundled taskset and the handlers


def bad_address(host: str, port: int) -> str | None:
    """Why the worker cannot listen at ``host:port``, naming the flag and the fix; None when it can."""
    if not 0 < port < 65536:  # 0 would leave the worker's URL unknown to the connector
        return f"--port {port} is not a TCP port; pass one in 1..65535"
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        return f"--host {host}: cannot be resolved ({e.strerror}); pass an address of this machine, e.g. 127.0.0.1"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp: TIME_WAIT is no conflict
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"--port {port}: {host}:{port} is in use ({e.strerror}); pass a free --port or stop "
                        "what listens there")
            return f"--host {host}: cannot listen there ({e.strerror}); pass an address of this machine"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the verifiers worker for miles' verifiers connector")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--taskset", default="vf_arith", help="verifiers taskset id (an importable module)")
    ap.add_argument("--max-tasks", type=int, default=4096, help="taskset rows loaded at start")
    args = ap.parse_args(argv)
    # bad input is one line naming the flag (exit 2, argparse's usage errors), not a traceback
    problem = bad_address(args.host, args.port)
    if args.max_tasks < 1:
        problem = f"--max-tasks {args.max_tasks}: pass a positive number of taskset rows"
    if problem:
        ap.exit(2, f"{ap.prog}: error: {problem}\n")
    # verifiers is imported only now: its import takes seconds, and a bad flag above needs none of it
    from aiohttp import web
    from vf_worker import Worker

    try:
        worker = Worker(args.taskset, args.max_tasks)
    except ImportError as e:  # verifiers' loader says which module it tried and where tasksets come from
        ap.exit(2, f"{ap.prog}: error: --taskset {args.taskset!r}: {e}\n")
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(worker.start)
    app.on_cleanup.append(worker.stop)
    app.router.add_get("/health", worker.health)
    app.router.add_post("/tasks", worker.list_tasks)
    app.router.add_post("/rollout", worker.rollout)
    print(f"verifiers worker ({args.taskset}, {len(worker.tasks)} tasks) on http://{args.host}:{args.port}",
          flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
