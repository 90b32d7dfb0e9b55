"""The layout of a batch's rows as megatron-core reads them: each row shifted left past its prompt
padding, so it starts at position 0 (megatron-core's RoPE numbers positions 0..S-1 in every row)."""
from __future__ import annotations

import torch
from miles import Batch, MilesError


def right_aligned(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows shifted left past their prompt padding, and the index of the logits that predict each
    response token. megatron-core's RoPE numbers positions 0..S-1 in every row, so a row must start
    at position 0 (as the HF model's ``position_ids`` do); the trailing padding then needs no mask
    under causal attention."""
    if batch.attention_mask is None or batch.attention_mask.dim() != 2:
        raise MilesError("trainer megatron: only 2-D attention masks (left-padded prompt, right-padded "
                         "response) are supported; packed rows (4-D masks) need trainer.name=fsdp2")
    ids, P = batch.input_ids, batch.prompt_len
    lead = (batch.attention_mask[:, :P] == 0).sum(1)
    index = (P - lead - 1)[:, None] + torch.arange(ids.shape[1] - P, device=ids.device)[None]
    return aligned_rows(batch, ids), index


def aligned_rows(batch: Batch, t: torch.Tensor) -> torch.Tensor:
    """``t [B, W]``, laid out per token of ``batch``'s rows, shifted left past the prompt padding
    as ``right_aligned`` shifts the ids (zeros after each row's end)."""
    W = t.shape[1]
    lead = (batch.attention_mask[:, :batch.prompt_len] == 0).sum(1).to(t.device)
    src = torch.arange(W, device=t.device)[None] + lead[:, None]
    return t.gather(1, src.clamp(max=W - 1)).masked_fill(src >= W, 0)
