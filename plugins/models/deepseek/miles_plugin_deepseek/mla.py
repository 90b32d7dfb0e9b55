"""Multi-latent attention decoding over the cached latent, for the engine's model instance.

transformers' ``DeepseekV3Attention`` caches what MLA needs per token and layer: the latent
``c_kv`` (``kv_lora_rank``, after ``kv_a_layernorm``) as the cache layer's keys and the rotated
shared key ``k_pe`` (``qk_rope_head_dim``) as its values, one "head" each, so ``reorder_cache`` and
``crop`` treat them as any keys and values. Its forward, though, expands the whole cache through
``kv_b_proj`` into per-head keys and values at every step. With a cache that already holds tokens
(decoding, or verifying drafted tokens) the forward here absorbs ``kv_b_proj`` instead: each
head's no-RoPE query goes through the key part of ``kv_b_proj`` into latent space, attention runs
over ``[c_kv, k_pe]`` as one shared key head with ``c_kv`` as the value, and the latent output goes
through the value part: ``O(tokens x (kv_lora_rank + qk_rope_head_dim))`` per head and step
instead of re-projecting every cached token. Prefill and cache-less forwards (scoring, training)
run transformers' own forward unchanged.
"""
from __future__ import annotations

import types
import weakref
from typing import Any

import torch

# quantized kv_b_proj modules -> (their tensors' identity and versions, the weight they compute)
_DERIVED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def absorb(model: torch.nn.Module) -> int:
    """Replace the forward of each ``DeepseekV3Attention`` in ``model`` (this instance only) by
    :func:`_forward`; the number replaced. Parameters, buffers and submodules are untouched."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    count = 0
    for module in model.modules():
        if isinstance(module, DeepseekV3Attention):
            module.forward = types.MethodType(_forward, module)  # shadows the class's forward
            count += 1
    return count


def _forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
             attention_mask: Any, cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    full = type(self).forward
    if cache is None or not _holds_tokens(cache, self.layer_idx):
        return full(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4):
        # an attention backend's own mask format (flash's 2-D padding mask, flex's block mask)
        return full(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    batch, length = hidden_states.shape[:-1]
    heads, nope, rope, rank = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_nope, q_rot = q.view(batch, length, heads, nope + rope).transpose(1, 2).split([nope, rope], dim=-1)
    latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([rank, rope], dim=-1)
    latent = self.kv_a_layernorm(latent).view(batch, 1, length, rank)
    k_rot = k_rot.view(batch, 1, length, rope)
    cos, sin = position_embeddings
    rotate = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    latent, k_rot = cache.update(latent, k_rot, self.layer_idx, kwargs=kwargs)  # [B, 1, T, rank | rope]

    w = _kv_b_weight(self.kv_b_proj, rank, latent.dtype).view(heads, nope + self.v_head_dim, rank)
    w_k, w_v = w[:, :nope], w[:, nope:]  # [H, nope, rank], [H, v, rank]
    # per-head products batched over heads, so the weights are read in place (a [B, H, ...] @ [H, ...]
    # matmul would broadcast them into a copy per row)
    q_lat = torch.bmm(q_nope.transpose(0, 1).reshape(heads, batch * length, nope), w_k)
    q_lat = q_lat.view(heads, batch, length, rank).transpose(0, 1).reshape(batch, heads * length, rank)
    q_rot = q_rot.reshape(batch, heads * length, rope)
    latent, k_rot = latent.squeeze(1), k_rot.squeeze(1)  # [B, T, rank], [B, T, rope]: one shared key head
    total = latent.shape[1]
    # heads x query positions are the rows of one product with the shared key: no per-head expansion
    scores = torch.bmm(q_lat, latent.transpose(1, 2)).baddbmm_(q_rot, k_rot.transpose(1, 2))
    scores = scores.view(batch, heads, length, total).mul_(self.scaling)
    if attention_mask is None and length > 1:  # causal over the new tokens, all cached ones visible
        attention_mask = torch.ones(length, total, dtype=torch.bool, device=scores.device).tril(total - length)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # sdpa's masks: True attends
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:  # eager's: added to the scores
            scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(latent.dtype)
    out = torch.bmm(probs.view(batch, heads * length, total), latent)  # [B, H * L, rank]
    out = out.view(batch, heads, length, rank).transpose(0, 1).reshape(heads, batch * length, rank)
    out = torch.bmm(out, w_v.transpose(1, 2))  # [H, B * L, v]
    out = out.view(heads, batch, length, self.v_head_dim).permute(1, 2, 0, 3)
    out = out.reshape(batch, length, heads * self.v_head_dim)
    return self.o_proj(out), None


def _holds_tokens(cache: Any, layer: int) -> bool:
    """Whether ``cache`` holds tokens for ``layer``, read on the host: a static layer's fill level
    is a device tensor (a CUDA graph replays it), but it holds tokens from its first update on."""
    from transformers.cache_utils import StaticLayer

    held = cache.layers[layer] if layer < len(cache.layers) else None  # MTP layers come after the model's
    if isinstance(held, StaticLayer):
        return held.is_initialized
    return cache.get_seq_length(layer) > 0


def _kv_b_weight(proj: torch.nn.Module, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """``kv_b_proj``'s ``[out, rank]`` weight in ``dtype``: a plain linear layer's own, or for a
    quantized replacement (FP8 / INT4 engine weights) its output on the identity, kept until one
    of its tensors changes in place (a weight sync bumps their version counters)."""
    if isinstance(proj, torch.nn.Linear):
        return proj.weight if proj.weight.dtype == dtype else proj.weight.to(dtype)
    tensors = [*proj.parameters(), *proj.buffers()]
    try:
        key = (dtype, *((t.data_ptr(), t._version) for t in tensors))
    except RuntimeError:  # inference tensors keep no version counter: derive it every time
        key = None
    held = _DERIVED.get(proj)
    if key is not None and held is not None and held[0] == key:
        return held[1]
    device = tensors[0].device if tensors else None
    w = proj(torch.eye(rank, dtype=dtype, device=device)).transpose(0, 1).contiguous()
    if key is not None:
        _DERIVED[proj] = (key, w)
    return w
