"""Read an offline W&B run back without uploading it: the records of its ``run-<id>.wandb``
transaction log, decoded with wandb's own protobuf messages."""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768  # the LevelDB log format's block size, which wandb's transaction log uses
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator[Any]:
    """Every ``wandb_internal_pb2.Record`` of a ``.wandb`` file, in order: a 7-byte header
    (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of chunks (CRC, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:7] != struct.pack("<4sHB", b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path} is not a W&B transaction log (bad header)")
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's padding: go on at the next block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if len(chunk) < length:  # cut off (a killed writer): the log ends before this record
            return
        buf = chunk if kind in (FULL, FIRST) else buf + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


def _items(items) -> dict[str, Any]:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def read_offline_run(path: str | Path) -> dict[str, Any]:
    """``{"name", "project", "config", "history": {step: {metric: value}}}`` of one ``.wandb`` file
    (wandb's own ``_step``/``_runtime``/``_timestamp`` keys left out of the rows)."""
    out: dict[str, Any] = {"name": None, "project": None, "config": {}, "history": {}}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(name=r.run.display_name, project=r.run.project, config=_items(r.run.config.update))
        elif kind == "history":
            row = _items(r.history.item)
            out["history"][row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    out["config"].pop("_wandb", None)
    return out


def last_offline_step(wandb_dir: str | Path, run_id: str) -> int:
    """The last step the offline segments of run ``run_id`` under ``wandb_dir`` hold (-1: none).
    A segment a killed process left unreadable counts for the steps read before the damage."""
    from google.protobuf.message import DecodeError

    last = -1
    for path in sorted(Path(wandb_dir).glob(f"offline-run-*/run-{run_id}.wandb")):
        try:
            for r in records(path):
                if r.WhichOneof("record_type") == "history":
                    step = _items(r.history.item).get("_step")
                    if isinstance(step, int):
                        last = max(last, step)
        except (ValueError, OSError, DecodeError):  # a bad header or a damaged record: keep what was read
            continue
    return last
