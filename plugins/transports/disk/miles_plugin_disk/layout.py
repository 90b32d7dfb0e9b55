"""On-disk layout of a weights folder (no torch here).

    <root>/LATEST                      name of the newest committed version folder
    <root>/v00000007/manifest.json     version, and per tensor: shard file, key, dtype, shape, checksum
    <root>/v00000007/model-00000.safetensors

A version is written to ``<folder>.tmp`` and renamed into place, so a folder without ``.tmp`` is
always complete. Re-writing a version that is already on disk (a run resumed from a checkpoint
syncs its version again) goes to ``v00000007.r1``, so the committed folder, which LATEST or a
delta manifest may still reference, is never modified.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterable

from miles.runfolder import fsync_path, write_atomic  # noqa: F401 (used by writer)
# the reading side of the format is shared with engines through the kernel (one copy)
from miles_wire import LATEST, MANIFEST, committed, latest  # noqa: F401
from miles_wire import parse_folder as parse


def folder_name(version: int, rev: int = 0) -> str:
    return f"v{version:08d}" + (f".r{rev}" if rev else "")


def new_folder(root: str, version: int) -> str:
    revs = [r for v, r, _ in committed(root) if v == version]
    return folder_name(version, max(revs) + 1 if revs else 0)


def write_manifest(folder_path: str, manifest: dict[str, Any]) -> None:
    write_atomic(os.path.join(folder_path, MANIFEST), json.dumps(manifest, indent=1))


def referenced(manifest: dict[str, Any]) -> set[str]:
    """Version folders holding the current bytes of some tensor of ``manifest``."""
    return {e["file"].split("/", 1)[0] for e in manifest["tensors"].values()}


def prune(root: str, newest: str, keep: int, refs: Iterable[str]) -> None:
    """Delete version folders beyond the ``keep`` newest, sparing those ``refs`` names.

    Versions above ``newest`` belong to a timeline abandoned by a resume and go too; so do
    superseded revisions of a version and ``.tmp`` leftovers of crashed writes.
    """
    top = parse(newest)[0]
    older: dict[int, str] = {}
    for v, _, name in committed(root):
        if v < top:
            older[v] = name  # ascending order, so the newest revision of each version wins
    recent = sorted(older)[-(keep - 1):] if keep > 1 else []
    kept = {newest, *refs, *(older[v] for v in recent)}
    for name in os.listdir(root):
        stale_tmp = name.endswith(".tmp") and parse(name[:-4]) is not None
        if stale_tmp or (parse(name) is not None and name not in kept):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
