"""GLM-5 (``glm_moe_dsa``) in the megatron trainer: its ``Arch`` facts and a layer-spec edit that
puts DeepSeek sparse attention into megatron-core's multi-latent attention.

megatron-core's own ``DSAttention`` (experimental) computes another indexer than transformers'
GLM-5: RoPE on the last dimensions instead of the first, a Hadamard rotation (bf16, CUDA only)
and the scale folded into the head weights. The core attention here computes transformers'
``GlmMoeDsaIndexer`` op for op (interleaved RoPE on the first ``qk_rope_head_dim`` dimensions,
LayerNorm'd key, ReLU scores weighted per head, top-k among the causal keys) and attends over
the selected keys only. megatron-core's MLA hands it the layer input and the normalised query
latent when the config says ``experimental_attention_variant="dsa"``, which the trainer sets from
the ``Arch``. Imported only for the megatron trainer (megatron-core is not a dependency otherwise).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from miles import MilesError
from miles_tokens.routing import sigmoid_moe_megatron


def megatron_arch(hf: Any) -> dict[str, Any]:
    """The ``Arch`` fields of a ``glm_moe_dsa`` config: DeepSeek-V3's MLA and routing plus the
    indexer's sizes; what megatron-core or this module computes otherwise is refused by key."""
    bad = []
    if getattr(hf, "attention_bias", False):
        bad.append("attention_bias: true (biases on the MLA projections)")
    if getattr(hf, "q_lora_rank", None) is None:
        bad.append("q_lora_rank: null (the indexer reads the query latent)")
    if getattr(hf, "hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {hf.hidden_act!r} (only silu)")
    if "shared" in (getattr(hf, "indexer_types", None) or ()):
        bad.append("indexer_types with 'shared' layers (each layer must run its own indexer: 'full')")
    if getattr(hf, "index_head_dim", 0) < hf.qk_rope_head_dim:
        bad.append(f"index_head_dim ({hf.index_head_dim}) below qk_rope_head_dim ({hf.qk_rope_head_dim})")
    if bad:
        raise MilesError(f"trainer megatron: glm_moe_dsa with model.config {'; '.join(bad)} is not supported")
    try:
        moe = sigmoid_moe_megatron(hf)
    except ValueError as e:
        raise MilesError(f"trainer megatron: {e}") from None
    kinds = list(getattr(hf, "mlp_layer_types", None) or ())
    if kinds:  # the per-layer list, where a config gives one, rules over first_k_dense_replace
        moe["dense_layers"] = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    # transformers' MLA here always rotates interleaved pairs, as megatron-core's MLA reads them
    return dict(moe, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_dim=hf.qk_nope_head_dim,
                qk_rope_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, latent_eps=1e-6,  # GlmMoeDsaRMSNorm's
                head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim, kv_heads=hf.num_attention_heads,
                index_heads=hf.index_n_heads, index_dim=hf.index_head_dim, index_topk=hf.index_topk)


def layer_spec(spec: Any) -> Any:
    """``spec`` with the sparse core attention in its (MLA) self-attention."""
    attention = spec.submodules.self_attention
    # a ModuleSpec (megatron-core 0.16) or functools.partial(Module, submodules=...) (later releases)
    sub = attention.keywords["submodules"] if isinstance(attention, functools.partial) else attention.submodules
    sub.core_attention = SparseAttention
    return spec


def _interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb_interleave`` for one tensor: pairs ``(x0, x1), ...``
    rotated, written de-interleaved (``cos``/``sin``: one angle per pair, broadcastable)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Indexer(torch.nn.Module):
    """The keys each query attends to: transformers' ``GlmMoeDsaIndexer`` on ``[s, b, ...]``
    inputs, megatron-core's DSA indexer names. Without gradients, as in transformers (its weights
    do not train), and replicated on every tensor-parallel rank (each computes the same choice)."""

    def __init__(self, config: Any):
        super().__init__()
        heads, dim, dtype = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim, config.params_dtype
        self.heads, self.dim, self.topk = heads, dim, config.dsa_indexer_topk
        self.rope_dim, self.base = config.qk_pos_emb_head_dim, config.rotary_base
        self.linear_wq_b = torch.nn.Linear(config.q_lora_rank, heads * dim, bias=False, dtype=dtype)
        self.linear_wk = torch.nn.Linear(config.hidden_size, dim, bias=False, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
        self.linear_weights_proj = torch.nn.Linear(config.hidden_size, heads, bias=False, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def _cos_sin(self, s: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' rotary angles for positions ``0..s-1`` (rows start at position 0)."""
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.rope_dim, 2, dtype=torch.int64).to(
            device=device, dtype=torch.float) / self.rope_dim))
        freqs = torch.arange(s, device=device)[None, :, None].float() * inv_freq  # [1, s, rope/2]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        """``[b, s, s]`` bool: causal and among the query's top-k keys."""
        x, qr = x.transpose(0, 1), qr.transpose(0, 1)  # [b, s, ...]
        b, s = x.shape[:2]
        cos, sin = self._cos_sin(s, x.device, x.dtype)
        q = self.linear_wq_b(qr).view(b, s, self.heads, self.dim)
        q_rot, q_pass = q.split([self.rope_dim, self.dim - self.rope_dim], dim=-1)
        k = self.k_norm(self.linear_wk(x))  # [b, s, dim]
        k_rot, k_pass = k.split([self.rope_dim, self.dim - self.rope_dim], dim=-1)
        q = torch.cat([_interleaved_rope(q_rot, cos[:, :, None], sin[:, :, None]), q_pass], dim=-1)
        k = torch.cat([_interleaved_rope(k_rot, cos, sin), k_pass], dim=-1)
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.dim ** -0.5)
        weights = self.linear_weights_proj(x).float() * (self.heads ** -0.5)
        index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [b, s, s]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        index = index.masked_fill(~causal, float("-inf"))
        chosen = index.topk(min(self.topk, s), dim=-1).indices
        return torch.zeros_like(index, dtype=torch.bool).scatter(-1, chosen, True) & causal


class SparseAttention(torch.nn.Module):
    """Core attention over each query's selected keys (``Indexer``), by SDPA under a boolean mask,
    as transformers' eager / SDPA paths compute DSA. Rows are right-padded and start at position 0,
    so the causal mask covers the padding."""

    # megatron-core >= 0.17 hands the layer input and compressed query (``x``, ``qr``) only to a
    # core attention that asks for them; older releases do when the variant is "dsa"
    requires_dsa_inputs = True

    def __init__(self, config: Any, layer_number: int = 0, attn_mask_type: Any = None,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, **_: Any):
        super().__init__()
        if config.context_parallel_size > 1 or config.sequence_parallel:
            raise MilesError("trainer megatron: GLM-5's sparse attention needs whole sequences on each rank "
                             "(no context or sequence parallelism)")
        self.scale = softmax_scale
        self.q_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.indexer = Indexer(config)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any = None,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None,
                x: torch.Tensor | None = None, qr: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        if x is None or qr is None:
            raise MilesError("trainer megatron: GLM-5's sparse attention got no layer input from megatron-core's "
                             "MLA (the config's experimental_attention_variant must be 'dsa'; "
                             "megatron-core 0.16 or later)")
        if value is None or query.shape[-1] != self.q_dim:  # an absorbed (latent-space) MLA query
            raise MilesError(f"trainer megatron: GLM-5's sparse attention needs megatron-core's up-projected MLA "
                             f"query, key and value (got a query of {query.shape[-1]} channels per head, "
                             f"expected {self.q_dim})")
        if packed_seq_params is not None:
            raise MilesError("trainer megatron: GLM-5's sparse attention does not take packed sequences")
        kept = self.indexer(x, qr)
        sq, b, heads = query.shape[:3]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=kept[:, None], scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * out.shape[-1])
