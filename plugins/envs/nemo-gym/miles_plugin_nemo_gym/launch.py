"""Start and stop NeMo Gym's servers (``ng_run``) for miles, in NeMo Gym's own virtualenv.

``python -m miles_plugin_nemo_gym.launch --policy-url http://127.0.0.1:30000/v1 --agent-port 8100``
builds the venv once (``scripts/make_venv.sh``), then runs ``ng_run`` from the bundled ``gym/``
folder with the ``miles_arith`` resources server, its ``simple_agent`` and the ``miles_model``
model server pointed at ``miles serve``. Every server reuses the one venv (``skip_venv_if_present``
with a ``.venv`` link per server), so no per-server install happens.

``ng_run`` starts a local Ray head. It gets a Ray of its own: a fresh temp dir (``RAY_TMPDIR``)
so it neither joins nor is found as another Ray's latest cluster, and token authentication with a
token only its processes hold (``RAY_AUTH_TOKEN``: nothing written to ``~/.ray``), so another
Ray client on the machine that probes for "any local cluster" cannot attach to it. Stopping
interrupts ``ng_run`` (which stops its servers and Ray), kills what is left of its process
session, then every process that still carries that temp dir (Ray's daemons and workers inherit
it), wherever it runs.
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from miles import MilesError
from miles_procs import (default_sigint, distinct_ports, free_port, kill_until_gone, serve_until_stopped, stop_session,
                         venv_from_script, wait_until_ready, work_folder)

from .client import health

GYM_ROOT = Path(__file__).parent / "gym"
MAKE_VENV = Path(__file__).resolve().parents[1] / "scripts" / "make_venv.sh"
SERVERS = {"resources_servers/miles_arith": "resources_servers/miles_arith/configs/miles_arith.yaml",
           "responses_api_models/miles_model": "responses_api_models/miles_model/configs/miles_model.yaml",
           "responses_api_agents/simple_agent": None}  # NeMo Gym's own agent; its config is in miles_arith.yaml
AGENT = "miles_arith_simple_agent"
PROG = "python -m miles_plugin_nemo_gym.launch"


def ensure_venv(timeout_s: float = 1800) -> Path:
    """The NeMo Gym venv, built by ``scripts/make_venv.sh`` if it is not there yet."""
    return venv_from_script(MAKE_VENV, timeout_s)


class GymServers:
    """``ng_run`` in its own process session; ``agent_url`` once ``start`` returns."""

    def __init__(self, policy_url: str, agent_port: int, head_port: int, work_dir: Path,
                 api_key: str = "none", model_name: str | None = None, resources_port: int | None = None,
                 wait_policy_s: float = 0.0):
        self.policy_url, self.agent_port, self.head_port = policy_url, agent_port, head_port
        self.resources_port = resources_port  # None: ng_run picks one
        self.work_dir, self.api_key, self.model_name = Path(work_dir), api_key, model_name
        self.wait_policy_s = wait_policy_s  # how long start() waits for miles serve to accept connections
        self.agent_url = f"http://127.0.0.1:{agent_port}"
        self.log = self.work_dir / "ng_run.log"
        self.proc: subprocess.Popen | None = None
        self.ray_dir: Path | None = None  # NeMo Gym's own Ray temp dir, while it runs

    def command(self, venv: Path) -> list[str]:
        links = self.work_dir / "venvs"
        for server in SERVERS:  # ng_run looks for <uv_venv_dir>/<type>/<name>/.venv
            link = links / server / ".venv"
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(venv, target_is_directory=True)
        ports = self.work_dir / "ports.yaml"
        text = (f"head_server:\n  host: 127.0.0.1\n  port: {self.head_port}\n"
                f"{AGENT}:\n  responses_api_agents:\n    simple_agent:\n"
                f"      host: 127.0.0.1\n      port: {self.agent_port}\n")
        if self.resources_port:
            text += (f"miles_arith:\n  resources_servers:\n    miles_arith:\n"
                     f"      host: 127.0.0.1\n      port: {self.resources_port}\n")
        ports.write_text(text)
        configs = [c for c in SERVERS.values() if c] + [str(ports)]
        return [str(venv / "bin" / "ng_run"), f"+config_paths=[{','.join(configs)}]",
                "+skip_venv_if_present=true", f"+uv_venv_dir={links}",
                f"+policy_base_url={self.policy_url}", f"+policy_api_key={self.api_key}",
                f"+policy_model_name={self.model_name}",
                f"hydra.run.dir={self.work_dir / 'hydra'}"]  # not outputs/ beside the bundled configs

    def start(self, timeout_s: float = 300) -> str:
        if self.model_name is None:  # a wrong --policy-url fails here, before minutes of venv building
            self.model_name = served_model(self.policy_url, self.api_key, self.wait_policy_s)
        venv = ensure_venv()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # short and under /tmp: Ray's socket paths inside it must stay under the kernel's 107 bytes
        self.ray_dir = Path(tempfile.mkdtemp(prefix="ngray", dir="/tmp"))
        env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(venv),
               "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(self.ray_dir),
               "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        for key in ("PYTHONPATH", "RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
            # miles' Python 3.11 paths must not leak into NeMo Gym's 3.12, nor another Ray's address
            env.pop(key, None)
        self.proc = subprocess.Popen(self.command(venv), cwd=GYM_ROOT, env=env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=default_sigint)
        wait_until_ready(self.proc, self._ready, self.stop, "NeMo Gym's ng_run", self.log, timeout_s, poll_s=1.0)
        return self.agent_url

    def _ready(self) -> bool:
        # ng_run prints "All N / N servers ready!" once every server answers its health check
        return re.search(r"All (\d+) / \1 servers ready", self.log.read_text()) is not None and health(self.agent_url)

    def stop(self, grace_s: float = 30) -> None:
        """Interrupt ``ng_run`` (its servers and Ray head stop with it), then kill what is left."""
        if self.proc is not None:
            stop_session(self.proc, grace_s)  # with Ray's daemons or a server that ignored SIGINT
            self.proc = None
        if self.ray_dir is not None:
            ray_dir = self.ray_dir
            kill_until_gone(lambda: ray_pids(ray_dir))  # a raylet may start one more worker meanwhile
            shutil.rmtree(self.ray_dir, ignore_errors=True)
            self.ray_dir = None


def ray_pids(ray_dir: Path) -> list[int]:
    """Live processes of the Ray that uses ``ray_dir``: those naming it on their command line
    (gcs_server, raylet, dashboard) or holding it as ``RAY_TMPDIR``, and their descendants
    (a process that retitles itself, e.g. ``ray::IDLE``, may overwrite both)."""
    needle, marker = str(ray_dir).encode(), f"RAY_TMPDIR={ray_dir}".encode()
    parents, marked = {}, set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            state, ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if state == "Z":
                continue
            parents[int(d.name)] = int(ppid)
            if needle in (d / "cmdline").read_bytes() or marker in (d / "environ").read_bytes().split(b"\0"):
                marked.add(int(d.name))
        except (OSError, ValueError):  # gone meanwhile, or another user's process
            continue
    grew = True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in marked} - marked
        marked |= more
        grew = bool(more)
    return sorted(marked)


def served_model(policy_url: str, api_key: str, wait_s: float = 0.0) -> str:
    """The model id ``miles serve`` answers to (its ``/v1/models``), so requests name it. A server
    that refuses connections (not up yet: the README starts both together) is asked again every
    second for up to ``wait_s`` seconds; any other answer is final."""
    import httpx

    try:
        parts = urlsplit(policy_url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # an unclosed "[" of an IPv6 host, a port out of range
        usable = False
    if not usable:
        raise MilesError(f"--policy-url {policy_url!r} is not an http(s) URL; pass miles serve's OpenAI base "
                         "URL, e.g. http://127.0.0.1:30000/v1")
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            r = httpx.get(f"{policy_url.rstrip('/')}/models", headers={"Authorization": f"Bearer {api_key}"},
                          timeout=10, trust_env=False)
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            if time.monotonic() >= deadline:
                waited = f" after waiting {wait_s:g} s (--wait-policy)" if wait_s > 0 else ""
                raise MilesError(f"no model listed at {policy_url}/models ({e}){waited}; is miles serve running "
                                 "there? (--policy-url is its base URL ending in /v1)") from None
            if not said:
                print(f"waiting up to {wait_s:g} s for miles serve at {policy_url} ...", file=sys.stderr, flush=True)
                said = True
            time.sleep(1.0)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, KeyError, IndexError, TypeError) as e:
            raise MilesError(f"no model listed at {policy_url}/models ({e}); is miles serve running there? "
                             "(--policy-url is its base URL ending in /v1)") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--policy-url", required=True, help="miles serve's OpenAI base URL, e.g. http://127.0.0.1:30000/v1")
    ap.add_argument("--agent-port", type=int, default=8100)
    ap.add_argument("--head-port", type=int, default=11000, help="NeMo Gym's head server")
    ap.add_argument("--work-dir", default="runs/nemo_gym_servers", help="logs and per-server venv links")
    ap.add_argument("--api-key", default=os.environ.get("MILES_API_KEY", "none"))
    ap.add_argument("--wait-policy", type=float, default=120.0, metavar="SECONDS",
                    help="how long to wait for miles serve to accept connections (started alongside)")
    args = ap.parse_args(argv)
    try:  # bad input is one line naming the flag (exit 2), as `miles` reports it, not a traceback
        distinct_ports({"--agent-port": args.agent_port, "--head-port": args.head_port})
        servers = GymServers(args.policy_url, free_port("--agent-port", args.agent_port),
                             free_port("--head-port", args.head_port), work_folder(args.work_dir),
                             api_key=args.api_key, wait_policy_s=args.wait_policy)
        # Ctrl-C or `kill` (SIGTERM) stops ng_run, its servers and its Ray; ng_run exiting by
        # itself is an error (exit 1) naming its exit code and log
        serve_until_stopped(lambda: f"NeMo Gym agent at {servers.start()} (log {servers.log}); Ctrl-C stops it",
                            lambda: servers.proc.poll(), servers.stop, "NeMo Gym's ng_run", servers.log)
    except MilesError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
