"""Routed experts (rollout routing replay, R3) in SGLang's ``/generate`` outputs.

Asked for with ``return_routed_experts: true``; an output's ``meta_info.routed_experts`` is the
base64 of an int32 array (little-endian, row-major) of the expert ids every token was routed to,
``[prompt + response - 1, layers, top_k]``. ``miles serve`` adds ``routed_experts_shape``; SGLang
does not (its clients reshape by their model config), and such a record stays flat here: the
model spec that replays it reshapes it by its own model. Completions carry it as
``Completion.extras["moe"]["routed_experts"]``, the key the ``moe`` model spec reads
(``miles.protocols.RecordsRouting``).
"""
from __future__ import annotations

import base64
import binascii
import math
import sys

import torch
from miles import Completion, MilesError

EXTENSION = "moe"


def decode_routed(meta: dict) -> torch.Tensor | None:
    """The int32 expert ids of one output's ``meta_info`` (shaped when it gives a shape), or None."""
    text = meta.get("routed_experts")
    if text is None:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise MilesError(f"/generate: meta_info.routed_experts is not base64 ({e})") from None
    if len(raw) % 4:
        raise MilesError(f"/generate: meta_info.routed_experts holds {len(raw)} bytes, not int32s")
    ids = torch.frombuffer(bytearray(raw), dtype=torch.int32)
    if sys.byteorder == "big":  # the wire is little-endian
        ids = ids.view(torch.uint8).view(-1, 4).flip(-1).contiguous().view(torch.int32).view(-1)
    shape = meta.get("routed_experts_shape")
    if shape is None:
        return ids
    if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)
            and math.prod(shape) == ids.numel()):
        raise MilesError(f"/generate: meta_info.routed_experts_shape {shape!r} does not fit its "
                         f"{ids.numel()} expert ids")
    return ids.view(*shape)


def attach(comp: Completion, meta: dict) -> Completion:
    routed = decode_routed(meta)
    if routed is not None:
        comp.extras[EXTENSION] = {"routed_experts": routed}
    return comp


def join_routed(first: Completion, rest: Completion, first_tokens: int) -> None:
    """``first``'s record after ``rest`` (generated from prompt + ``first``'s ``first_tokens``
    tokens) was appended: ``first``'s rows (each token as it was routed when generated), then
    ``rest``'s rows past them; only ``rest``'s when ``first`` had no token or a flat record."""
    a = (first.extras.get(EXTENSION) or {}).get("routed_experts")
    b = (rest.extras.get(EXTENSION) or {}).get("routed_experts")
    if b is None:
        first.extras.pop(EXTENSION, None)  # a record that stops short would misalign the replay
        return
    if a is not None and first_tokens > 0 and a.dim() > 1 and b.dim() > 1:
        b = torch.cat([a, b[a.shape[0]:]])
    first.extras[EXTENSION] = {"routed_experts": b}
