"""The ``disk`` transport's folder format (the version protocol): ``LATEST`` names the newest
committed ``vNNNNNNNN[.rN]`` folder, each with a ``manifest.json`` (per tensor: file, key, dtype,
shape, optional blake2b) over safetensors shards; readers load a version shard by shard."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from miles import MilesError

from .dtypes import checksum, dtype_name

if TYPE_CHECKING:  # pragma: no cover
    import torch

LATEST = "LATEST"
MANIFEST = "manifest.json"
_FOLDER = re.compile(r"^v(\d{8})(?:\.r(\d+))?$")


def parse_folder(name: str) -> tuple[int, int] | None:
    """(version, rev) of a committed version folder name (``v00000007``, ``v00000007.r1``)."""
    m = _FOLDER.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def committed(root: str) -> list[tuple[int, int, str]]:
    """Committed version folders as (version, rev, name), oldest first."""
    found = [(*p, n) for n in os.listdir(root)
             if (p := parse_folder(n)) and os.path.isdir(os.path.join(root, n))]
    return sorted(found)


def latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def read_manifest(dir: str | os.PathLike, version: int | None = None) -> dict[str, Any]:
    """The manifest of ``version`` (its newest revision), or of the newest version when None."""
    root = os.fspath(dir)
    if version is None:
        folder = latest(root)
        if folder is None:
            raise MilesError(f"no weights in {root}: there is no {LATEST} file")
    else:
        folders = [n for v, _, n in committed(root) if v == int(version)] if os.path.isdir(root) else []
        if not folders:
            raise MilesError(f"no weights of version {version} in {root}")
        folder = folders[-1]
    try:
        with open(os.path.join(root, folder, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise MilesError(f"cannot read the manifest of {os.path.join(root, folder)}: {e}") from e


def load_version(dir: str | os.PathLike, version: int | None = None, *,
                 verify: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every tensor of a version, read shard by shard.

    The manifest is read now (so a missing version fails here), the tensors lazily.
    ``verify`` recomputes each tensor's checksum and raises ``MilesError`` naming it on a mismatch.
    """
    root = os.fspath(dir)
    manifest = read_manifest(root, version)
    by_file: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, entry in manifest["tensors"].items():
        by_file.setdefault(entry["file"], []).append((name, entry))
    return _stream(root, by_file, verify)


def _stream(root: str, by_file: dict, verify: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    # one shard open at a time: delta manifests spread tensors over several version folders
    for file, items in by_file.items():
        path = os.path.join(root, file)
        try:
            handle = safe_open(path, framework="pt")
        except (OSError, SafetensorError) as e:
            raise MilesError(f"cannot open shard {path} (holds {items[0][0]}): {e}") from e
        with handle as f:
            for name, entry in items:
                try:
                    t = f.get_tensor(entry["key"])
                except (OSError, SafetensorError) as e:
                    raise MilesError(f"cannot read tensor {name} from {path}: {e}") from e
                _check(name, entry, t, verify)
                yield name, t


def _check(name: str, entry: dict[str, Any], t: torch.Tensor, verify: bool) -> None:
    if dtype_name(t.dtype) != entry["dtype"] or list(t.shape) != entry["shape"]:
        raise MilesError(f"weight sync: tensor {name} on disk is {dtype_name(t.dtype)}{list(t.shape)}, "
                         f"the manifest says {entry['dtype']}{entry['shape']}")
    if verify and "blake2b" not in entry:
        raise MilesError(f"weight sync: tensor {name} was written without a checksum, so it cannot be "
                         "verified (the writer computes them when transport.verify or transport.delta is on)")
    if verify and checksum(t) != entry["blake2b"]:
        raise MilesError(f"weight sync verification failed: tensor {name} in {entry['file']} "
                         "does not match its manifest checksum (corrupted shard?)")
