"""Durable writes: a file or a rename survives a crash once these return; a full disk is a clear error."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..errors import MilesError


def fsync_path(path: str) -> None:
    """fsync a file or folder (a folder's fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see either the old file or the whole new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
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
    with under 64 MiB left on the disk counts as a full disk too."""
    try:
        yield
    except BaseException as e:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        chain = [e, *(x for x in (e.__cause__, e.__context__) if x is not None)]  # DCP wraps errors
        if not isinstance(e, (KeyboardInterrupt, SystemExit)) and (free < 64 << 20 or any(
                getattr(x, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(x) for x in chain)):
            raise MilesError(f"disk full while writing in {folder} ({free >> 10} KiB free); any previous "
                             f"checkpoint is intact. Free space (or lower run.keep_checkpoints) and rerun "
                             f"to resume") from e
        raise
