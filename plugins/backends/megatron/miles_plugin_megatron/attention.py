"""Core attention for the megatron trainer without Transformer Engine: PyTorch's fused
scaled-dot-product kernels, with the sliding windows and learned sinks some families need."""
from __future__ import annotations

from typing import Any

import torch
from miles import MilesError


class SDPAttention(torch.nn.Module):
    """Causal core attention by ``torch.nn.functional.scaled_dot_product_attention`` (flash /
    memory-efficient kernels), in place of the local spec's ``DotProductAttention``, which
    materialises every ``[S, S]`` score matrix. Rows are right-padded, so a causal mask is exact.
    It reads the config as ``DotProductAttention`` does: this layer's sliding window
    (``window_size``, ``window_attn_skip_freq``) and learned sinks (``softmax_type="learnable"``:
    a per-head ``softmax_offset`` logit in every softmax, whose value vector is zero)."""

    def __init__(self, config: Any, layer_number: int = 0, attn_mask_type: Any = None,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, **_: Any):
        from megatron.core.transformer.utils import is_layer_window_attention

        super().__init__()
        self.config = config
        self.scale = softmax_scale
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, max(1, layer_number))
        self.window = config.window_size[0] if windowed else None
        self.softmax_offset = None
        if config.softmax_type == "learnable":
            heads = config.num_attention_heads // config.tensor_model_parallel_size
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
        elif config.softmax_type != "vanilla":
            raise MilesError(f"trainer megatron: softmax_type {config.softmax_type!r} is not supported")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The sinks split by head over the TP ranks, as the heads are (megatron-core's
        ``DotProductAttention`` marks them so too), so a checkpoint loads at another TP size."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"softmax_offset": 0}, sharded_offsets)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        sq, b, heads, dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        gqa = k.shape[1] != heads  # grouped-query attention: each K/V head serves heads/groups queries
        native = gqa and _flash_gqa(q) and self.softmax_offset is None and self.window is None
        if gqa and not native:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        if self.softmax_offset is None and self.window is None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                                   **({"enable_gqa": True} if native else {}))
        else:
            out = self._masked(q, k, v)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * out.shape[-1])  # MLA: V's head size

    def _masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention under an additive mask: causal, within the window, and with sinks one more key
        (zero key and value) whose mask entry is the head's sink logit, so its softmax share is the
        sink's and the gradient reaches it through the mask."""
        s = q.shape[2]
        i = torch.arange(s, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if self.window is not None:
            allowed &= i[None, :] >= i[:, None] - self.window
        mask = torch.zeros(s, s, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        if self.softmax_offset is not None:
            heads = q.shape[1]
            sink = self.softmax_offset.to(q.dtype).view(heads, 1, 1).expand(heads, s, 1)
            mask = torch.cat([mask.expand(heads, s, s), sink], dim=-1)[None]
            k, v = (torch.cat([t, t.new_zeros(*t.shape[:2], 1, t.shape[3])], dim=2) for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)


def _flash_gqa(q: torch.Tensor) -> bool:
    """Whether SDPA can take grouped K/V heads as they are: its fused CUDA kernels (flash, cuDNN)
    read them without copies in half precision (head dim <= 256); elsewhere ``enable_gqa`` would
    fall back to the slow math kernel, so K/V are repeated instead."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and torch.backends.cuda.flash_sdp_enabled())
