"""Token samples padded into a training batch's tensors (``miles.Batch.from_samples``' layout)."""
from __future__ import annotations

from typing import Any


def pad_samples(samples: list, pad_id: int, advantages: Any = None) -> dict[str, Any]:
    """The tensor fields of ``miles.Batch`` for token samples: prompts left-padded to the longest
    (width P), responses right-padded (width R >= 1), so every response is ``[:, P:]``;
    ``advantages``: per sample a float (broadcast over its response tokens) or a list of
    per-token floats; default 0. The global denominators are this batch's own totals."""
    import torch

    P = max(len(s.prompt_ids) for s in samples)
    R = max(1, max(len(s.response_ids) for s in samples))
    ids, attn, lmask, adv, rlp = [], [], [], [], []
    for i, s in enumerate(samples):  # plain lists, then one tensor each: much faster than per row
        p, r = len(s.prompt_ids), len(s.response_ids)
        tail = [0] * (R - r)
        ids.append([pad_id] * (P - p) + list(s.prompt_ids) + list(s.response_ids) + [pad_id] * (R - r))
        attn.append([0] * (P - p) + [1] * (p + r) + tail)
        lmask.append(list(s.loss_mask[:r]) + tail)
        rlp.append((list(s.logprobs[:r]) if s.logprobs else [0.0] * r) + tail)
        a = 0.0 if advantages is None else advantages[i]
        adv.append((list(a[:r]) if isinstance(a, (list, tuple)) else [float(a)] * r) + tail)
    ids, attn = torch.tensor(ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long)
    lmask, adv, rlp = (torch.tensor(x, dtype=torch.float) for x in (lmask, adv, rlp))
    return {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "prompt_len": P, "loss_mask": lmask, "advantages": adv, "rollout_logprobs": rlp,
            "rewards": torch.tensor([float(s.reward or 0.0) for s in samples]),
            "global_tokens": float(lmask.sum().clamp(min=1)), "global_samples": len(samples)}
