"""Run untrusted code in a subprocess: no network, resource limits, a throwaway directory.

Layout of one run (the usual case, util-linux ``unshare`` available):

    unshare --fork --pid --mount-proc --net --ipc --uts --kill-child   (new namespaces)
      python _launch.py          pid 1 of the new pid namespace; hides paths, mounts a private
        -> exec the code         /tmp, sets rlimits, drops to a throwaway uid (when root), execs

The pid namespace is what makes cleanup complete: when its first process exits or is killed, the
kernel kills every process left in it, including ones that escaped the process group with
``setsid``. ``--kill-child`` forwards our SIGKILL of ``unshare`` (wall-clock timeout) to it.
The working directory lives in a tmpfs of the private mount namespace, so it disappears with it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles import MilesError

from . import cgroup

LAUNCHER = str(Path(__file__).with_name("_launch.py"))
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
SETUP_FAILED = 125  # the launcher's exit status when it could not set the sandbox up
SANDBOX_DIR = "/tmp/sandbox"  # the code's working directory (inside the private /tmp)
# host folders the code sees (read-only): programs, libraries and system configuration
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")


class SandboxError(MilesError):
    """The sandbox cannot be set up as asked (e.g. no way to cut the network)."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. ``cpu_s`` defaults to the wall-clock timeout (rounded up); every process
    of the run gets these rlimits. ``max_procs`` counts threads too (Linux RLIMIT_NPROC).
    ``memory_mb`` bounds all the run's processes together: one cgroup holds them where the host
    allows it, else the run gets fewer processes, each with a share (``SandboxResult.memory_bound``)."""

    cpu_s: int | None = None
    memory_mb: int = 1024  # all processes of the run together
    max_procs: int = 64
    file_size_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    open_files: int = 256
    tmpfs_mb: int = 64  # size of the private /tmp that holds the working directory
    max_output_bytes: int = 65536  # stdout and stderr are each cut to this many bytes


@dataclass(frozen=True)
class SandboxResult:
    """What the caller gets back from every run (failures of the code are results, not errors).
    ``returncode`` is negative when a signal ended the code (-9: killed, e.g. at the timeout or for
    memory). ``memory_bound`` says how ``Limits.memory_mb`` was enforced; ``memory_peak_mb`` is the
    run's peak (all processes together) where a cgroup measured it."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    truncated: bool = False
    duration_s: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    memory_bound: str = ""
    memory_peak_mb: float | None = None


def run_python(code: str, timeout_s: float = 10.0, *, limits: Limits | None = None,
               network: str = "deny", files: dict[str, str] | None = None, stdin: str = "",
               hide: list[str] | tuple[str, ...] = (), allow: list[str] | tuple[str, ...] = ()) -> SandboxResult:
    """Run ``code`` as ``main.py`` with this interpreter (``-E -s``: no PYTHON* variables, no
    user site-packages) in the sandbox; see ``run_shell`` for the other arguments."""
    return _run([sys.executable, "-E", "-s", "main.py"], "main.py", code, timeout_s, limits,
                network, files, stdin, hide, allow)


def run_shell(command: str, timeout_s: float = 10.0, *, limits: Limits | None = None,
              network: str = "deny", files: dict[str, str] | None = None, stdin: str = "",
              hide: list[str] | tuple[str, ...] = (), allow: list[str] | tuple[str, ...] = (),
              shell: str = "/bin/sh") -> SandboxResult:
    """Run the shell script ``command`` in the sandbox.

    ``network``: "deny" (default; raises ``SandboxError`` when no network namespace can be made)
    or "allow". ``files``: extra files (relative path -> text) written into the working
    directory. ``stdin``: the code's standard input. The code sees only the system folders
    (``SYSTEM_PATHS``) and the interpreter's prefix of the host, read-only; ``allow``: more host
    paths to show it (read-only). ``hide``: paths inside those to cover with an empty read-only
    directory (the caller's working directory and ``$HOME`` always are)."""
    return _run([shell, "script.sh"], "script.sh", command, timeout_s, limits, network, files,
                stdin, hide, allow)


def _run(argv: list[str], name: str, code: str, timeout_s: float, limits: Limits | None,
         network: str, files: dict[str, str] | None, stdin: str, hide, allow) -> SandboxResult:
    if network not in ("deny", "allow"):
        raise SandboxError(f"sandbox: network={network!r}; use 'deny' or 'allow'")
    if not timeout_s or timeout_s <= 0:
        raise SandboxError(f"sandbox: timeout_s must be positive, got {timeout_s!r}")
    limits = limits or Limits()
    files = {**(files or {}), name: code}
    for rel in files:
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise SandboxError(f"sandbox: file name {rel!r} must be relative, inside the working directory")
    prefix, notes = _namespace_prefix(network)
    workdir = SANDBOX_DIR if prefix else tempfile.mkdtemp(prefix="miles-sandbox-")
    is_root = os.geteuid() == 0
    uid = 100000 + secrets.randbelow(60000) if is_root else None  # its own uid: its own NPROC count
    group, no_group = cgroup.make(limits.memory_mb, limits.max_procs)
    if group is not None:
        procs, each_mb = limits.max_procs, limits.memory_mb
        bound = f"cgroup {group.version}: {limits.memory_mb} MiB for all processes"
    else:
        procs, each_mb = cgroup.divided(limits.memory_mb, limits.max_procs)
        bound = f"rlimit: {procs} process(es) x {each_mb} MiB (no cgroup: {no_group})"
    spec = {"argv": argv, "workdir": workdir, "files": files, "stdin": stdin, "mounts": bool(prefix),
            "hide": _hidden_paths(hide) if prefix else [], "allow": _allowed_paths(allow), "uid": uid,
            "env": _env(workdir),
            "rlimits": _rlimits(limits, timeout_s, procs, each_mb), "tmpfs_mb": limits.tmpfs_mb,
            "cgroup": group.procs if group else None}
    try:
        r = _spawn(prefix + [sys.executable, "-E", "-s", "-S", LAUNCHER], spec, timeout_s,
                   limits.max_output_bytes, notes)
        if group is None:
            return dataclasses.replace(r, memory_bound=bound)
        kills = group.oom_kills()
        oom = (f"out of memory: {kills} process(es) killed at the {limits.memory_mb} MiB limit",) if kills else ()
        return dataclasses.replace(r, memory_bound=bound, memory_peak_mb=group.peak_mb(), notes=r.notes + oom)
    finally:
        if group is not None:
            group.remove()
        if not prefix:
            shutil.rmtree(workdir, ignore_errors=True)


def _env(workdir: str) -> dict[str, str]:
    """A scrubbed environment: nothing of the caller's (keys, tokens, paths) reaches the code."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
            "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _rlimits(limits: Limits, timeout_s: float, procs: int, each_mb: int) -> dict[str, list[int]]:
    mb = 1024 * 1024
    cpu = limits.cpu_s or max(1, int(-(-timeout_s // 1)))
    return {"RLIMIT_CPU": [cpu, cpu + 1], "RLIMIT_AS": [each_mb * mb] * 2,
            "RLIMIT_NPROC": [procs] * 2, "RLIMIT_FSIZE": [limits.file_size_mb * mb] * 2,
            "RLIMIT_NOFILE": [limits.open_files] * 2, "RLIMIT_CORE": [0, 0]}


def _kept_paths() -> list[str]:
    """The interpreter's prefixes: never hidden."""
    return sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)})


def _allowed_paths(extra) -> list[str]:
    """What the code's root holds of the host (read-only), outermost first: the system folders,
    the interpreter's prefixes and ``extra``."""
    paths = {*SYSTEM_PATHS, *_kept_paths(), *(os.path.realpath(p) for p in extra)}
    return sorted(paths, key=lambda p: (p.count("/"), p))


def _hidden_paths(extra) -> list[str]:
    """The caller's working directory (often the run folder) and home, plus ``extra``, outermost
    first; never ``/`` nor a folder inside the interpreter's prefix."""
    keep = _kept_paths()
    out = []
    try:
        cwd = [os.getcwd()]
    except FileNotFoundError:  # the caller's folder was deleted: nothing there to hide
        cwd = []
    for p in [*cwd, os.path.expanduser("~"), *extra]:
        real = os.path.realpath(p)
        if real == "/" or any(real == k or real.startswith(k + "/") or k.startswith(real + "/") for k in keep):
            continue
        if os.path.exists(real) and real not in out:
            out.append(real)
    return sorted(out, key=len)


@functools.cache
def _probe(flags: tuple[str, ...]) -> str | None:
    """None when ``unshare FLAGS true`` works here, else why not (checked once per process)."""
    try:
        r = subprocess.run([UNSHARE, *flags, "true"], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{UNSHARE}: {e}"
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit status {r.returncode}")


def _namespace_prefix(network: str) -> tuple[list[str], tuple[str, ...]]:
    """The ``unshare`` command line for this run, or [] (plain subprocess) when namespaces are
    unavailable and the caller allowed the network."""
    flags = ["--fork", "--pid", "--mount-proc", "--ipc", "--uts", "--kill-child"]
    if os.geteuid() != 0:
        flags.append("--map-root-user")  # an unprivileged user namespace makes the rest possible
    if network == "deny":
        flags.append("--net")
    why = _probe(tuple(flags))
    if why is None:
        return [UNSHARE, *flags, "--"], ()
    if network == "deny":
        raise SandboxError(
            f"sandbox: cannot create a network namespace ({why}); install util-linux's unshare and "
            f"run as root or with unprivileged user namespaces enabled, or pass network='allow' "
            f"to run the code with the network reachable")
    return [], (f"no namespaces ({why}): ran as a plain subprocess with rlimits",)


def _drain(pipe, limit: int, out: list) -> None:
    """Keep the first ``limit`` bytes, read (and drop) the rest so the code never blocks."""
    kept, total = bytearray(), 0
    while chunk := pipe.read1(65536):
        total += len(chunk)
        if len(kept) < limit:
            kept += chunk[:limit - len(kept)]
    out.extend([bytes(kept), total > limit])


def _spawn(cmd: list[str], spec: dict, timeout_s: float, max_out: int,
           notes: tuple[str, ...]) -> SandboxResult:
    started = time.monotonic()
    status_r, status_w = os.pipe()  # the launcher reports the code's exit status here
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={"PATH": "/usr/bin:/bin"}, cwd="/", start_new_session=True,
                                pass_fds=(status_w,))
    except OSError:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    with os.fdopen(status_r, "rb") as status:
        return _collect(proc, {**spec, "status_fd": status_w}, status, timeout_s, max_out, notes, started)


def _collect(proc: subprocess.Popen, spec: dict, status, timeout_s: float, max_out: int,
             notes: tuple[str, ...], started: float) -> SandboxResult:
    outs: tuple[list, list] = ([], [])
    readers = [threading.Thread(target=_drain, args=(pipe, max_out, o), daemon=True)
               for pipe, o in zip((proc.stdout, proc.stderr), outs)]
    for t in readers:
        t.start()
    try:
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
    except BrokenPipeError:  # the launcher died before reading: its stderr says why
        pass
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(proc)
    for t in readers:
        t.join(5)  # a leftover process may hold the pipe (plain-subprocess mode only)
    (out, cut_out), (err, cut_err) = (o if len(o) == 2 else [b"", False] for o in outs)
    stderr = err.decode("utf-8", "replace")
    if proc.returncode == SETUP_FAILED and "miles-sandbox: setup failed" in stderr:
        raise SandboxError(stderr.strip().splitlines()[-1])
    reported = status.read()  # empty when the launcher was killed (the timeout)
    returncode = json.loads(reported)["returncode"] if reported else proc.returncode
    return SandboxResult(out.decode("utf-8", "replace"), stderr, returncode, timed_out,
                         cut_out or cut_err, round(time.monotonic() - started, 3), notes)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
