"""Count the tensor operations that make the host wait for the device, on CPU.

On CPU a host read of tensor data costs nothing; on a GPU each one blocks the host until the launch
queue drains, so a decode loop that reads once per step or per layer can no longer queue ahead of
the GPU. ``count_syncs`` finds them in a CPU run, where they are free to observe:

    with count_syncs() as syncs:
        engine.generate(prompts, params)
    print(syncs.total, syncs.by_site())

Two modes watch together. A ``TorchDispatchMode`` sees the aten operations that read device data
on the host or have a data-dependent output shape (``item``/``bool``/``int``/``float`` via
``_local_scalar_dense``, ``nonzero``, ``unique``, ``masked_select``, boolean-mask indexing,
``repeat_interleave`` without ``output_size``, ``torch.equal``, ``bincount``...): each is counted
once at the outermost aten call, so an op that decomposes into others is not counted twice. A
``TorchFunctionMode`` sees the device-to-host copies that are no-ops on a CPU tensor and so never
reach aten there (``tolist``, ``cpu``, ``numpy``, ``to("cpu")`` with the host named as a string),
and tensors made from host data for a given device (``torch.tensor(list, device=...)``, a
blocking host-to-device copy on a GPU). Every count carries the ``file:line`` of the first Python
frame outside torch (and this module), so it can be attributed.

A CPU run cannot tell which tensors would live on the host in a GPU run, so a ``.item()`` of a
tensor that is on CPU by design is counted too: the counts are an upper bound.
"""
from __future__ import annotations

import collections
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "SyncCounter", "count_syncs", "syncs_per_step"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)

_aten = torch.ops.aten
# aten overload packets whose every call syncs (a host read, or an output shape known only from data)
_ALWAYS = {
    _aten._local_scalar_dense: "item", _aten.item: "item", _aten.is_nonzero: "item",
    _aten.nonzero: "nonzero", _aten.argwhere: "nonzero",
    _aten.masked_select: "masked_select",
    _aten.unique_consecutive: "unique", _aten.unique_dim: "unique", _aten._unique: "unique",
    _aten._unique2: "unique", _aten.unique_dim_consecutive: "unique",
    _aten.equal: "equal", _aten.allclose: "equal",
    _aten.bincount: "bincount",
}
# repeats given as a tensor: the output length is their sum, read on the host unless output_size says it
_REPEAT = _aten.repeat_interleave.Tensor
# boolean-mask indexing (x[mask], x[mask] = v): the mask's nonzero count sets the shape
_INDEX = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}
# Python-level device->host copies; a CPU tensor's are no-ops that never reach aten
_D2H_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu"}
# a tensor made from host data on a named device: a blocking host->device copy on a GPU
_H2D = {torch.tensor, torch.as_tensor}


def _site() -> str:
    """``file:line`` of the innermost Python frame outside torch and this module."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and os.path.abspath(path) != _HERE and not path.startswith("<"):
            return f"{path}:{f.f_lineno}"
        f = f.f_back
    return "?"


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """``Tensor.to("cpu")``: the host named as such. A ``torch.device`` usually comes from another
    tensor (``x.to(y.device)``), which on a GPU run is the GPU: not counted."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, str) and torch.device(target).type == "cpu"


def _host_data(data: Any) -> bool:
    """Python or NumPy data with at least one element (an empty tensor copies nothing)."""
    if isinstance(data, torch.Tensor):
        return False
    try:
        return len(data) > 0
    except TypeError:  # a Python scalar
        return True


class OpCounter(TorchDispatchMode):
    """Counts the aten calls made while it is active (``n``), or only those of the overload
    packets in ``only`` (e.g. ``{torch.ops.aten.mm}``): a kernel count a CPU run can take."""

    def __init__(self, only: set | None = None) -> None:
        super().__init__()
        self.only, self.n = only, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.n += self.only is None or func.overloadpacket in self.only
        return func(*args, **(kwargs or {}))


@dataclass
class SyncCounter:
    """Host syncs seen while active: one ``(kind, site)`` entry per operation."""

    events: list[tuple[str, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.events)

    def by_kind(self) -> dict[str, int]:
        return dict(collections.Counter(k for k, _ in self.events))

    def by_site(self) -> dict[str, int]:
        """``"kind at file:line" -> count``, most frequent first."""
        return dict(collections.Counter(f"{k} at {s}" for k, s in self.events).most_common())

    def where(self, *needles: str) -> int:
        """Events whose site's path contains any of ``needles`` (e.g. ``"miles_plugin_"``)."""
        return sum(any(n in s for n in needles) for _, s in self.events)


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        kind = _ALWAYS.get(packet)
        if func is _REPEAT and kwargs.get("output_size") is None:
            kind = "repeat_interleave"
        elif packet in _INDEX:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                kind = "bool_index"
        if kind:
            self.counter.events.append((kind, _site()))
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter
        # the result of the last call if it was a counted copy to the host: ``x.cpu().tolist()`` is one
        # copy (a CPU tensor's ``cpu()`` returns itself, so only the very next call can be told apart)
        self.fetched: weakref.ref | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _D2H_METHODS.get(func)
        if kind is None and func is torch.Tensor.to and _to_cpu(args, kwargs):
            kind = "to_cpu"
        elif func in _H2D and kwargs.get("device") is not None and args and _host_data(args[0]):
            kind = "h2d"
        elif kind in ("tolist", "numpy") and self.fetched is not None and self.fetched() is args[0]:
            kind = None  # the copy that made it was counted: reading a host tensor is free
        self.fetched = None
        if kind:
            self.counter.events.append((kind, _site()))
        out = func(*args, **kwargs)
        if kind in ("cpu", "to_cpu") and isinstance(out, torch.Tensor):
            self.fetched = weakref.ref(out)
        return out


class count_syncs:
    """Context manager: a ``SyncCounter`` of the host syncs inside the block (CPU tensors)."""

    def __init__(self) -> None:
        self.counter = SyncCounter()
        self._modes = (_Function(self.counter), _Dispatch(self.counter))

    def __enter__(self) -> SyncCounter:
        for m in self._modes:
            m.__enter__()
        return self.counter

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


def syncs_per_step(run: Callable[[int], Any], short: int, long: int) -> tuple[float, SyncCounter]:
    """Syncs per decode step of ``run(new_tokens)``: the difference between a ``long`` and a
    ``short`` run over the steps between them, so prefill and per-call costs cancel; and the
    long run's events beyond the short run's (their sites are the per-step ones)."""
    with count_syncs() as a:
        run(short)
    with count_syncs() as b:
        run(long)
    return (b.total - a.total) / (long - short), _diff(b, a)


def _diff(long: SyncCounter, short: SyncCounter) -> SyncCounter:
    """The events of ``long`` beyond ``short``'s, per (kind, site)."""
    extra = collections.Counter(long.events) - collections.Counter(short.events)
    return SyncCounter([e for e, n in extra.items() for _ in range(n)])

