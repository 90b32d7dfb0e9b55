"""One memory bound for all the processes of a sandbox call.

An rlimit bounds each process on its own (four children of 700 MB each pass a 1 GiB RLIMIT_AS), so
a call's processes share one cgroup instead, as systemd bounds a service: cgroup v2 (``memory.max``,
``memory.swap.max``, ``pids.max``) or, on hosts that mount only the v1 memory hierarchy,
``memory.limit_in_bytes``. The cgroup is a child of the caller's own; the sandbox's first process
joins it before it starts the code, so everything the code starts is inside. Where no cgroup can be
made, :func:`divided` splits the limit among fewer processes instead.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

MIN_PROC_MB = 128  # the smallest per-process share worth running (numpy with one thread imports)


def divided(memory_mb: int, max_procs: int) -> tuple[int, int]:
    """(processes, MiB each) with processes x MiB <= ``memory_mb``: the rlimit bound without cgroups."""
    procs = max(1, min(max_procs, memory_mb // MIN_PROC_MB))
    return procs, memory_mb // procs


def _mounts() -> dict[str, str]:
    """Mount points of the cgroup hierarchies: "v2" -> path, "memory" -> path of the v1 memory one."""
    found: dict[str, str] = {}
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = right.split()[:3]
            point = left.split()[4]
            if fstype == "cgroup2":
                found.setdefault("v2", point)
            elif fstype == "cgroup" and "memory" in options.split(","):
                found.setdefault("memory", point)
    return found


def _own(version: str) -> str | None:
    """This process's cgroup path in the v2 hierarchy ("v2") or the v1 memory one ("memory")."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == "v2" and controllers == "") or (version in controllers.split(",") and version != "v2"):
            return path
    return None


@dataclass
class CallGroup:
    """A cgroup made for one call; ``procs`` is the file a process writes 0 to, to join it."""

    path: Path
    version: str  # "v2" or "v1"

    @property
    def procs(self) -> str:
        return str(self.path / "cgroup.procs")

    def _read(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.path / name).read_text()
        return ""

    def peak_mb(self) -> float | None:
        raw = self._read("memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes").strip()
        return round(int(raw) / 2**20, 1) if raw.isdigit() else None

    def oom_kills(self) -> int:
        events = self._read("memory.events" if self.version == "v2" else "memory.oom_control")
        return next((int(v) for k, v in (ln.split() for ln in events.splitlines() if ln.strip())
                     if k == "oom_kill"), 0)

    def remove(self) -> None:
        """Kill what is left (the pid namespace normally took it already), then remove the cgroup."""
        with contextlib.suppress(OSError):
            (self.path / "cgroup.kill").write_text("1")  # v2 only
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY: its last processes are still exiting
                time.sleep(0.02)


def _v2_parent(own: Path, top: Path) -> Path:
    """Where a v2 call group can go: under this process's cgroup once it hands memory down to
    children, else beside it. A cgroup that holds processes may not enable controllers for children
    (EBUSY, the no-internal-processes rule), but its parent already hands memory down to it."""
    try:
        if "memory" not in (own / "cgroup.subtree_control").read_text().split():
            (own / "cgroup.subtree_control").write_text("+memory +pids")
        return own
    except OSError:
        if own == top:
            raise
        return own.parent


def make(memory_mb: int, max_procs: int) -> tuple[CallGroup | None, str]:
    """A fresh cgroup bounding one call to ``memory_mb`` MiB in all (and ``max_procs`` tasks on v2),
    or None and why none could be made here."""
    mounts, why = _mounts(), []
    for version, key in (("v2", "v2"), ("v1", "memory")):
        own = _own(key)
        if key not in mounts or own is None:
            why.append(f"{version}: not mounted")
            continue
        parent = Path(mounts[key]) / own.lstrip("/")
        try:
            if version == "v2":
                if "memory" not in (parent / "cgroup.controllers").read_text().split():
                    why.append("v2: the memory controller is not delegated here")
                    continue
                parent = _v2_parent(parent, Path(mounts[key]))
            group = CallGroup(parent / f"miles-sandbox-{os.getpid()}-{secrets.token_hex(4)}", version)
            group.path.mkdir()
        except OSError as e:
            why.append(f"{version}: {e.strerror or e} in {parent}")
            continue
        try:
            limit = str(memory_mb * 2**20)
            if version == "v2":
                (group.path / "memory.max").write_text(limit)
                for name, value in (("memory.swap.max", "0"), ("pids.max", str(max_procs))):
                    if (group.path / name).exists():
                        (group.path / name).write_text(value)
            else:
                (group.path / "memory.limit_in_bytes").write_text(limit)
                if (group.path / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no escape to swap
                    (group.path / "memory.memsw.limit_in_bytes").write_text(limit)
        except OSError as e:
            group.remove()
            why.append(f"{version}: cannot set its limits ({e.strerror or e})")
            continue
        return group, ""
    return None, "; ".join(why)
