"""Durable writes: a file or a rename survives a crash once these return; a full disk is a clear error."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import MilesError


def fsync_path(path: str) -> None:
    """fsync a file or folder (a folder's fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str | bytes) -> None:
    """Write ``text`` to ``path`` so that readers see either the old file or the whole new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with disk_errors(Path(path).parent), open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    fsync_path(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def disk_errors(folder: Path, tmp: Path | None = None) -> Iterator[None]:
    """A full disk inside becomes a MilesError naming ``folder``; ``tmp`` is removed on any error.
    Writers do not always pass ENOSPC on (torch's zip writer reports a bad position), so a failure
    that carries no OS error of its own while under 64 MiB are left counts as a full disk too; an OS
    error of another kind (read-only, permission, a /proc path) is said as what it is."""
    try:
        yield
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (KeyboardInterrupt, SystemExit, MilesError)):
            raise
        chain = [e, *(x for x in (e.__cause__, e.__context__) if x is not None)]  # DCP wraps errors
        codes = [x.errno for x in chain if isinstance(x, OSError) and x.errno]
        usage = _usage(folder)
        if any(c in (errno.ENOSPC, errno.EDQUOT) for c in codes) or any("No space left" in str(x) for x in chain) \
                or (not codes and usage is not None and usage.total > 0 and usage.free < 64 << 20):
            free = f" ({usage.free >> 10} KiB free)" if usage is not None else ""
            raise MilesError(f"disk full while writing in {folder}{free}; any previous checkpoint is intact. "
                             f"Free space (or lower run.keep_checkpoints) and rerun to resume") from e
        if codes:
            raise MilesError(f"cannot write in {folder}: {os.strerror(codes[0])}; any previous checkpoint is "
                             f"intact. Fix the folder (or pick another run.out_dir) and rerun to resume") from e
        raise


def _usage(folder: Path) -> Any:
    """``shutil.disk_usage`` of ``folder`` or its nearest existing parent (None if unreadable)."""
    for p in (folder, *folder.parents):
        try:
            return shutil.disk_usage(p)
        except OSError:
            continue
    return None


def check_writable(folder: Path, key: str = "run.out_dir") -> None:
    """Refuse a folder miles could not write into, before anything is written: the nearest existing
    folder on its path gets a probe file that is removed at once (this is what catches /proc,
    read-only mounts and missing permissions alike)."""
    try:
        folder.resolve(strict=False)
    except (OSError, RuntimeError) as e:
        raise MilesError(f"{key} {folder} cannot be resolved ({e}): a symlink loop? point it at a real "
                         f"folder") from None
    if folder.is_symlink() and not folder.exists():
        raise MilesError(f"{key} {folder} is a symlink that leads nowhere (dangling, or a loop); point it "
                         f"at a real folder")
    base = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if base is None or not base.is_dir():
        raise MilesError(f"{key} {folder} cannot be created: {base} is not a folder; pick another path")
    try:
        st = base.stat()
        fd, probe = tempfile.mkstemp(prefix=".miles-probe-", dir=base)
        os.close(fd)
        os.remove(probe)
        os.utime(base, ns=(st.st_atime_ns, st.st_mtime_ns))  # the folder looks untouched afterwards
    except OSError as e:
        raise MilesError(f"{key} {folder} is not writable ({base}: {e.strerror}); pick a folder you can "
                         f"write, e.g. under your home or the project") from None


@contextlib.contextmanager
def leave_as_found(folder: str, active: bool = True) -> Iterator[None]:
    """On an error inside, remove what the block created in ``folder`` (all of it, if the folder
    did not exist), so a run that fails while starting leaves no trace. Files that were there
    stay; writers inside replace files only as their last act."""
    root = Path(folder)
    before = {p for p in root.rglob("*")} if active and root.is_dir() else None
    existed = root.exists()
    try:
        yield
    except BaseException:
        if active and not existed:
            shutil.rmtree(root, ignore_errors=True)
        elif active and before is not None:
            for p in sorted(set(root.rglob("*")) - before, key=lambda q: len(q.parts), reverse=True):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        p.unlink()
        raise
