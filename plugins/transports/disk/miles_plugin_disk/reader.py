"""Engine side of the ``disk`` transport, public so that ``miles serve`` can reload weights from disk."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterator

import torch
from miles import MilesError
from safetensors import SafetensorError, safe_open

from . import layout


def checksum(t: torch.Tensor) -> str:
    """blake2b-128 of a contiguous CPU tensor's raw bytes (any dtype, bfloat16 included)."""
    return hashlib.blake2b(t.reshape(-1).view(torch.uint8).numpy(), digest_size=16).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_manifest(dir: str | os.PathLike, version: int | None = None) -> dict[str, Any]:
    """The manifest of ``version`` (its newest revision), or of the newest version when None."""
    root = os.fspath(dir)
    if version is None:
        folder = layout.latest(root)
        if folder is None:
            raise MilesError(f"no weights in {root}: there is no {layout.LATEST} file")
    else:
        folders = [n for v, _, n in layout.committed(root) if v == version] if os.path.isdir(root) else []
        if not folders:
            raise MilesError(f"no weights of version {version} in {root}")
        folder = folders[-1]
    try:
        with open(os.path.join(root, folder, layout.MANIFEST)) as f:
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
    if verify and checksum(t) != entry["blake2b"]:
        raise MilesError(f"weight sync verification failed: tensor {name} in {entry['file']} "
                         "does not match its manifest checksum (corrupted shard?)")
