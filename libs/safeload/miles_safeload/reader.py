"""A DCP ``FileSystemReader`` that unpickles nothing it has not allowed.

DCP keeps a checkpoint's ``.metadata`` as a plain pickle and each non-tensor item (an optimizer's
hyper-parameters, megatron-core's ``_extra_state``) as a ``torch.save`` pickle; torch's reader
loads both with no restriction, so a planted checkpoint file would run its code on load.
"""
from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

# DCP's metadata and save-plan records (megatron-core keeps every rank's save plan in .metadata)
_META_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                 "torch.distributed.checkpoint.planner")
_META_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath")}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata records (dataclasses and enums only: building one runs no code), torch sizes,
    dtypes and layouts, and paths."""

    def find_class(self, module: str, name: str) -> Any:
        ok = ((module, name) in _META_NAMES or module in _META_MODULES
              or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        obj = super().find_class(module, name) if ok else None
        record = isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
        if obj is None or (module in _META_MODULES and not record):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")
        return obj


class _PlainBytes:
    """The planner DCP hands to ``read_data``, except that a non-tensor item reaches it only once
    ``torch.load(weights_only=True)`` accepts the item's bytes."""

    def __init__(self, planner: Any, reader: SafeReader) -> None:
        self._planner, self._reader = planner, reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from miles import MilesError

        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            self._reader.refused = MilesError(
                f"{self._reader.path}: checkpoint item {read_item.dest_index.fqn} is not plain data "
                f"(refused to unpickle it): {str(e).splitlines()[0]}")
            raise self._reader.refused from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)  # the same bytes, now known to hold only allowed values


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata and non-tensor items go through allow-lists. What it
    refused is also kept in ``refused``: DCP wraps errors raised inside a load in its own."""

    def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.refused: Exception | None = None
        self._metadata: dict[Any, Any] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from miles import MilesError

        rank = kwargs.get("rank")
        if rank not in self._metadata:  # read once: callers such as megatron-core ask again after a load
            try:
                with open(self._get_metadata_path(rank), "rb") as f:
                    meta = MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
                self.refused = MilesError(f"{self.path} has a damaged or unsafe .metadata ({e}); it was not loaded")
                raise self.refused from None
            meta.storage_meta = getattr(meta, "storage_meta", None) or __import__(
                "torch.distributed.checkpoint.metadata", fromlist=["StorageMeta"]).StorageMeta()
            self._metadata[rank] = meta
        meta = self._metadata[rank]
        meta.storage_meta.load_id = self.load_id
        return meta

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:  # another folder: its own metadata
            self._metadata.clear()

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _PlainBytes(planner, self))

