"""Engine extras (``Completion.extras``) of every turn, carried into the one sample.

An engine returns per-position records in the layout ``miles.protocols.RecordsRouting`` documents
for routed experts: one row per token it fed through the model, ``[len(prompt) + len(tokens) - 1,
...]`` (the last generated token is never fed). Each turn's prompt is the whole sequence so far,
so a later turn's record also covers the earlier turns and the tool tokens between them. The
stitched record keeps, for every position, the row of the first forward that fed it: the prompt
from turn one's prefill, each model token from the decode step that read it, tool tokens (and
the last token of the turn before them) from the next turn's prefill. Tool tokens no later turn
read (a trajectory that ends on a tool result) get filler rows of -1, which the ``moe`` spec
replays as "route as usual". The result is ``[prompt + response - 1, ...]``, as for one turn.

A flat record (1-D, ``fed x k`` entries: SGLang's ``routed_experts`` without a shape, which the
``moe`` spec reshapes by its model) is stitched as ``fed`` rows of ``k`` and handed on flat.
Values that are not such position records are kept as a list with one entry per turn.
"""
from __future__ import annotations

from typing import Any


def _position_rows(value: Any, fed: int) -> tuple[Any, bool]:
    """(``value`` as rows, one per fed position; whether it came flat), or (None, False)."""
    if isinstance(value, (list, tuple)) and len(value) == fed and fed > 0:
        import torch

        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError):
            return None, False
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) < 1 or fed <= 0:
        return None, False
    if len(shape) == 1 and shape[0] >= fed and shape[0] % fed == 0:
        return value.reshape(fed, -1), True
    return (value, False) if shape[0] == fed else (None, False)


class StitchedExtras:
    """The extras of one trajectory's turns (see the module docstring)."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], Any] = {}  # (extension, name) -> rows so far
        self.per_turn: dict[tuple[str, str], list] = {}
        self.flat: set[tuple[str, str]] = set()  # records that came 1-D and are handed on 1-D

    def add(self, extras: dict, prefix_len: int, generated: int, kept_len: int) -> None:
        """One turn's ``extras``: its prompt had ``prefix_len`` tokens, the engine generated
        ``generated`` and the trajectory kept the sequence to ``kept_len`` tokens."""
        fed = prefix_len + generated - 1
        for ext, payload in (extras or {}).items():
            items = payload.items() if isinstance(payload, dict) else [("", payload)]
            for name, value in items:
                rows, flat = _position_rows(value, fed)
                if rows is None:
                    self.per_turn.setdefault((ext, name), []).append(value)
                    continue
                if flat:
                    self.flat.add((ext, name))
                self._append(ext, name, rows, kept_len)

    def _append(self, ext: str, name: str, rows: Any, kept_len: int) -> None:
        import torch

        have = self.records.get((ext, name))
        start = 0 if have is None else have.shape[0]
        new = rows[start:].to(have.device) if have is not None else rows
        joined = new if have is None else torch.cat([have, new])
        self.records[(ext, name)] = joined[:max(kept_len - 1, 0)]

    def extensions(self, total_len: int) -> dict:
        """``Sample.extensions`` entries for a sequence of ``total_len`` tokens."""
        out: dict = {}
        for (ext, name), rows in self.records.items():
            want = max(total_len - 1, 0)
            if rows.shape[0] < want:
                import torch

                fill = torch.full((want - rows.shape[0], *rows.shape[1:]), -1, dtype=rows.dtype, device=rows.device)
                rows = torch.cat([rows, fill])
            rows = rows[:want].contiguous()
            _put(out, ext, name, rows.reshape(-1) if (ext, name) in self.flat else rows)
        for (ext, name), values in self.per_turn.items():
            if (ext, name) not in self.records:
                _put(out, ext, name, values)
        return out


def _put(out: dict, ext: str, name: str, value: Any) -> None:
    if name == "":
        out[ext] = value
    else:
        out.setdefault(ext, {})[name] = value
