"""Sequence packing: several SFT examples per row, with no attention across examples.

Flash-style variable-length attention is not available on CPU, so isolation comes from the mask:
each row carries a prepared 4-D boolean attention mask ``[B, 1, L, L]`` that is causal *within*
an example and False across examples (block-diagonal), and position ids restart at 0 for every
example, so each example sees exactly the positions and keys it would see alone. Hugging Face
models pass a 4-D mask through unchanged (SDPA, the default attention, reads True as "may
attend"). Padding positions attend only to themselves, which keeps their softmax finite.

Layout (a ``miles.Batch``): ``prompt_len = 1``, so the "response" region is every token after a
row's first; ``loss_mask[:, t - 1]`` is 1 where token ``t`` is a trained (assistant) token. The
first token of every example is a prompt token, so no loss ever spans two examples.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from miles import Batch, Sample


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices per row: each example goes into the first row with room (input order kept, so
    the random draw order of the step decides the rows). Longer-than-capacity examples get a
    row of their own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(capacity - n)
    return rows


def _row(samples: list[Sample]) -> tuple[list[int], list[int], list[int], list[int]]:
    """ids, segment ids, position ids and per-token target mask of one packed row."""
    ids, seg, pos, target = [], [], [], []
    for k, s in enumerate(samples):
        tokens = list(s.prompt_ids) + list(s.response_ids)
        ids += tokens
        seg += [k] * len(tokens)
        pos += list(range(len(tokens)))
        target += [0] * len(s.prompt_ids) + [int(m) for m in s.loss_mask[:len(s.response_ids)]]
    return ids, seg, pos, target


def block_causal_mask(seg: torch.Tensor) -> torch.Tensor:
    """``[B, 1, L, L]`` bool: query i may attend key j iff j <= i and both are in one segment
    (segment ids < 0 mark padding, each padding position being its own segment)."""
    L = seg.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    same = seg[:, :, None] == seg[:, None, :]
    return (same & causal)[:, None]


def pack(samples: list[Sample], pad_id: int, length: int) -> Batch:
    """A packed ``Batch`` of ``samples`` (prompt_ids + response_ids + loss_mask each)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    groups = first_fit(lengths, length)
    rows = [_row([samples[i] for i in g]) for g in groups]
    L = max(len(r[0]) for r in rows)
    ids, seg, pos, target = [], [], [], []
    for r_ids, r_seg, r_pos, r_target in rows:
        pad = L - len(r_ids)
        ids.append(r_ids + [pad_id] * pad)
        seg.append(r_seg + [-1 - j for j in range(pad)])  # unique: a pad attends to itself only
        pos.append(r_pos + [0] * pad)
        target.append(r_target + [0] * pad)
    ids_t, seg_t = torch.tensor(ids), torch.tensor(seg)
    loss_mask = torch.tensor(target, dtype=torch.float)[:, 1:]  # token t is predicted at t - 1
    B, R = len(rows), L - 1
    # one placeholder Sample per row (Batch rows and samples stay aligned for select/split);
    # its prompt is the row's first token, its response the rest, as in the tensors
    row_samples = [Sample(task=samples[g[0]].task, prompt_ids=r[0][:1], response_ids=r[0][1:],
                          loss_mask=r[3][1:], extensions={"sft": {"examples": len(g)}})
                   for g, r in zip(groups, rows)]
    rewards = torch.tensor([sum(float(samples[i].reward or 0.0) for i in g) / len(g) for g in groups])
    zeros = torch.zeros(B, R)
    return Batch(ids_t, block_causal_mask(seg_t), torch.tensor(pos), 1, loss_mask, zeros.clone(),
                 zeros.clone(), rewards, row_samples, global_tokens=float(loss_mask.sum().clamp(min=1)),
                 global_samples=B, extras={"packed_examples": len(samples)})
