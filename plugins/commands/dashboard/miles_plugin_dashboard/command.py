"""``miles dashboard``'s arguments and access policy, then the web server (uvicorn)."""
from __future__ import annotations

import argparse
from pathlib import Path

from miles import MilesError
from miles_procs import api_key, listening_socket

LOOPBACK = ("127.0.0.1", "::1", "localhost")
DEFAULT_PORT = 8686


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("run_dirs", nargs="*", metavar="RUN_DIR",
                    help="run folders (run.out_dir), or folders of runs; default: the runs under ./runs")
    sp.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 picks a "
                    "free one, printed)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (not loopback: needs an API key)")
    sp.add_argument("--api-key", default=None, help="require this key (visible in ps: prefer --api-key-file "
                    "or $MILES_API_KEY)")
    sp.add_argument("--api-key-file", default=None, help="read the API key from this file")


def run(args: argparse.Namespace) -> int:
    from .runs import RunView, find_runs

    key = api_key(args)
    if args.host not in LOOPBACK and not key:
        raise MilesError(f"--host {args.host} shows your runs beyond this machine: pass --api-key KEY "
                         f"(or --api-key-file / $MILES_API_KEY), or bind 127.0.0.1")
    paths = args.run_dirs or (["runs"] if Path("runs").is_dir() else [])
    if not paths:
        raise MilesError("no RUN_DIR given and no ./runs folder here; pass run folders (run.out_dir), "
                         "e.g. miles dashboard runs/quickstart")
    folders = find_runs(paths)
    names = _names(folders)
    views = [RunView(f, n) for f, n in zip(folders, names)]
    import uvicorn

    from .app import build_app

    sock = listening_socket(args.host, args.port)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"miles dashboard: http://{host}:{port}/ ({len(views)} run{'s' * (len(views) != 1)}: "
          f"{', '.join(names)})" + ("; open it once with ?key=KEY" if key else ""), flush=True)
    server = uvicorn.Server(uvicorn.Config(build_app(views, key), log_level="warning", access_log=False))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    return 0


def _names(folders: list[Path]) -> list[str]:
    """Short names that tell the runs apart: the folder name, with its parent where two clash."""
    names = [f.name or str(f) for f in folders]
    return [f"{f.parent.name}/{n}" if names.count(n) > 1 else n for f, n in zip(folders, names)]
