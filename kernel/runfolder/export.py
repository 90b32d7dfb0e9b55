"""``miles export``'s target folder: checked before anything is built, filled through a temp folder."""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..errors import MilesError

from .files import disk_errors


def check_export_target(run: Path, to: Path, force: bool) -> None:
    """A new or empty folder (or any folder with ``force``); never the run folder itself or its
    checkpoints (a subfolder such as ``RUN/export`` is fine)."""
    if to.exists() and not to.is_dir():
        raise MilesError(f"--to {to} is a file; pass a folder (new or empty)")
    run_dir, target, ckpts = run.resolve(), to.resolve(), (run / "checkpoints").resolve()
    if target == run_dir or target == ckpts or ckpts in target.parents:
        raise MilesError(f"--to {to} is the run folder {run} or its checkpoints; export to a new folder, "
                         f"e.g. {run}/export")
    if to.is_dir() and any(to.iterdir()) and not force:
        raise MilesError(f"--to {to} is not empty; pick a new folder, or pass --force to write into it "
                         f"(same-named files are replaced, nothing else is removed)")


@contextlib.contextmanager
def export_folder(to: Path) -> Iterator[Path]:
    """A temp folder beside ``to`` to fill; then its files move into ``to``. On any failure the
    temp folder and the parent folders this made are removed."""
    made = [p for p in to.parents if not p.exists()]
    tmp = to.parent / f".{to.name}.tmp-{os.getpid()}"
    try:
        with disk_errors(to.parent, tmp):
            to.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            if not to.exists():
                os.replace(tmp, to)
                return
            for f in sorted(tmp.rglob("*")):
                dest = to / f.relative_to(tmp)
                if f.is_dir():
                    dest.mkdir(exist_ok=True)
                else:
                    os.replace(f, dest)
            shutil.rmtree(tmp)
    except BaseException:
        for p in made:  # deepest first; only folders that are still empty
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
