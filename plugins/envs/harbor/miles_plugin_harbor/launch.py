"""Start and stop ``harbor serve`` for miles, in Harbor's own virtualenv, and build the local
container image the bundled tasks use.

``python -m miles_plugin_harbor.launch --port 8390`` builds the venv once
(``scripts/make_venv.sh``), imports ``localhost/miles-harbor-base`` into podman when it is
missing (a root filesystem of this host's bash, sh and coreutils: no registry pull), and runs
``harbor serve --host 127.0.0.1``. Podman gets a ``containers.conf`` (via ``CONTAINERS_CONF``)
choosing runc and lowered ulimits, which hosts that forbid raising ulimits or run crun on hybrid
cgroups need. Stopping interrupts the server, then kills what is left of its process session.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from miles import MilesError
from miles_procs import (default_sigint, free_port, serve_until_stopped, stop_session, venv_from_script,
                         wait_until_ready, work_folder)

MAKE_VENV = Path(__file__).resolve().parents[1] / "scripts" / "make_venv.sh"
AGENT_DIR = Path(__file__).resolve().parent / "agent"  # miles_harbor_agent, imported by Harbor
BASE_IMAGE = "localhost/miles-harbor-base:latest"
PROG = "python -m miles_plugin_harbor.launch"
TOOLS = ["bash", "sh", "cat", "echo", "mkdir", "chmod", "rm", "cp", "mv", "ls", "sleep", "env", "tar",
         "test", "timeout", "mktemp", "stat", "gzip", "base64", "find", "head", "tail", "tee", "true"]
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
runtime = "runc"
"""


def ensure_venv(timeout_s: float = 1800) -> Path:
    """The Harbor venv, built by ``scripts/make_venv.sh`` if it is not there yet, with the
    ``miles_harbor_agent`` agent installed in it."""
    venv = venv_from_script(MAKE_VENV, timeout_s)
    install_agent(venv)
    return venv


def install_agent(venv: Path) -> Path:
    """Put ``miles_harbor_agent`` (and its ``miles_harbor_chat``) on the venv's import path with a
    ``.pth`` file, so Harbor imports this plugin's copy: ``miles_harbor_agent:MilesAgent``."""
    sites = sorted(Path(venv).glob("lib/python3*/site-packages"))
    if not sites:
        raise MilesError(f"{venv}: no lib/python3*/site-packages; rebuild it with {MAKE_VENV}")
    pth = sites[0] / "miles_harbor_agent.pth"
    if not pth.is_file() or pth.read_text().strip() != str(AGENT_DIR):
        pth.write_text(f"{AGENT_DIR}\n")
    return pth


def ensure_base_image(env: dict[str, str]) -> str:
    """Import ``BASE_IMAGE`` into podman from this host's own binaries, unless it exists."""
    if not shutil.which("podman"):
        raise MilesError("podman is not installed (apt-get install podman podman-compose runc)")
    if subprocess.run(["podman", "image", "exists", BASE_IMAGE], env=env).returncode == 0:
        return BASE_IMAGE
    files: set[Path] = set()
    for tool in TOOLS:
        exe = shutil.which(tool)
        if exe:
            files.add(Path(exe))
            files.update(_libraries(Path(exe)))
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "rootfs.tar"
        with tarfile.open(tar, "w") as out:
            for d in ("tmp", "app", "logs", "root"):
                info = tarfile.TarInfo(d)
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
                out.addfile(info)
            for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/bash\n"), ("etc/group", "root:x:0:\n")):
                data = text.encode()  # "exec -u root" needs a root user in the image
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                out.addfile(info, io.BytesIO(data))
            for d in ("bin", "sbin", "lib", "lib64"):  # merged-/usr hosts: /bin -> usr/bin, ...
                if Path("/", d).is_symlink():
                    _symlink(out, d, os.readlink(Path("/", d)))
            seen: set[Path] = set()
            for f in sorted(files):
                _add(out, f, seen)
        # SIGKILL stops a trial's container at once: Harbor's keep-alive `sleep infinity` is PID 1 and
        # ignores SIGTERM, which would cost podman's 10 s stop timeout per trial
        p = subprocess.run(["podman", "import", "--change", "STOPSIGNAL=SIGKILL", str(tar), BASE_IMAGE],
                           capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise MilesError(f"podman import of {BASE_IMAGE} failed: {p.stderr[-800:]}")
    return BASE_IMAGE


def _symlink(out: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    out.addfile(info)


def _add(out: tarfile.TarFile, f: Path, seen: set[Path]) -> None:
    """``f`` at its path with directory links resolved; a file link is kept, with its target."""
    p = Path(os.path.realpath(f.parent)) / f.name
    if p in seen:
        return
    seen.add(p)
    if p.is_symlink():
        target = os.readlink(p)
        _symlink(out, str(p).lstrip("/"), target)
        _add(out, Path(target) if os.path.isabs(target) else p.parent / target, seen)
    else:
        out.add(p, arcname=str(p).lstrip("/"))


def _libraries(exe: Path) -> list[Path]:
    out = subprocess.run(["ldd", str(exe)], capture_output=True, text=True).stdout
    libs = []
    for line in out.splitlines():
        parts = line.split()  # "libc.so.6 => /lib/.../libc.so.6 (0x...)" or "/lib64/ld-linux... (0x...)"
        path = parts[2] if "=>" in parts and len(parts) > 2 else (parts[0] if parts else "")
        if path.startswith("/"):
            libs.append(Path(path))
    return libs


class HarborServer:
    """``harbor serve`` in its own process session; ``url`` once ``start`` returns."""

    def __init__(self, port: int, work_dir: Path):
        self.port, self.work_dir = port, Path(work_dir)
        self.url = f"http://127.0.0.1:{port}"
        self.log = self.work_dir / "harbor_serve.log"
        self.proc: subprocess.Popen | None = None

    def environment(self, venv: Path) -> dict[str, str]:
        conf = self.work_dir / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(venv),
               "CONTAINERS_CONF": str(conf), "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)  # miles' Python 3.11 paths must not leak into Harbor's 3.12
        return env

    def start(self, timeout_s: float = 120, base_image: bool = True) -> str:
        venv = ensure_venv()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        env = self.environment(venv)
        if base_image:
            ensure_base_image(env)
        cmd = [str(venv / "bin" / "harbor"), "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--data-dir", str(self.work_dir / "data")]
        # SIGINT at its default in the server even from a background job: stop() interrupts it first
        self.proc = subprocess.Popen(cmd, cwd=self.work_dir, env=env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=default_sigint)
        wait_until_ready(self.proc, self._ready, self.stop, "harbor serve", self.log, timeout_s)
        return self.url

    def _ready(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/agents", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace_s: float = 20) -> None:
        if self.proc is None:
            return
        stop_session(self.proc, grace_s)  # with the trial processes (podman, compose) the server left
        self.proc = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8390)
    ap.add_argument("--work-dir", default="runs/harbor_server", help="logs, data, containers.conf")
    args = ap.parse_args(argv)
    try:  # bad input is one line naming the flag (exit 2), as `miles` reports it, not a traceback
        server = HarborServer(free_port("--port", args.port), work_folder(args.work_dir))
        # Ctrl-C or `kill` (SIGTERM) stops the server and the trial processes it left; the server
        # exiting by itself is an error (exit 1) naming its exit code and log
        serve_until_stopped(lambda: f"Harbor server at {server.start()} (log {server.log}); Ctrl-C stops it",
                            lambda: server.proc.poll(), server.stop, "harbor serve", server.log)
    except MilesError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
