"""``load_weights`` of the sglang engine: one weight version in the shared disk format
(``miles_wire``: ``LATEST`` + ``vNNNNNNNN/manifest.json`` + safetensors), which the torch
server's ``update_weights_from_disk`` reads. Whole versions only (the ``disk`` transport adds
deltas, sharding and retention on top of the same format)."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterable

import miles_wire as W
from miles import MilesError
from miles.runfolder import fsync_path, write_atomic

SHARD = "model-00000.safetensors"


def write_version(root: str, named: Iterable[tuple[str, Any]], version: int) -> str:
    """Write ``named`` as ``version`` under ``root``, point ``LATEST`` at it, delete the older
    folders; returns the folder name. Nothing is visible before the final rename."""
    from safetensors.torch import save_file

    os.makedirs(root, exist_ok=True)
    revs = [r for v, r, _ in W.committed(root) if v == int(version)]
    folder = f"v{int(version):08d}" + (f".r{max(revs) + 1}" if revs else "")
    tmp = os.path.join(root, folder + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        tensors, entries, total = {}, {}, 0
        for name, t in named:
            if name in entries:
                raise MilesError(f"load_weights: tensor {name} given twice")
            # a copy of its own: safetensors refuses tensors that share memory (tied embeddings)
            t = t.detach().to("cpu").contiguous().clone()
            entries[name] = {"dtype": W.dtype_name(t.dtype), "shape": list(t.shape),
                             "nbytes": W.nbytes(t), "blake2b": W.checksum(t),
                             "file": f"{folder}/{SHARD}", "key": name}
            tensors[name] = t
            total += W.nbytes(t)
        save_file(tensors, os.path.join(tmp, SHARD), metadata={"format": "pt"})
        manifest = {"format": "miles-disk/1", "version": int(version), "total_bytes": total,
                    "tensors": entries}
        write_atomic(os.path.join(tmp, W.MANIFEST), json.dumps(manifest))
        fsync_path(tmp)
        os.replace(tmp, os.path.join(root, folder))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(os.path.join(root, W.LATEST), folder + "\n")
    for _, _, name in W.committed(root):
        if name != folder:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return folder
