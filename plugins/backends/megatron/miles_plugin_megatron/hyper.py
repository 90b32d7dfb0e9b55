"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4) in megatron-core layers.

The residual is ``hc_mult`` streams per token instead of one. Before each attention and MLP block a
small projection of the (normalised, flattened) streams gives three weights: ``pre`` collapses the
streams into the block's input, ``post`` spreads the block's output back over them, and ``comb``
(made doubly stochastic by Sinkhorn iterations) mixes the old streams into the new ones. After the
last layer a head collapses the streams before the final norm.

megatron-core's ``TransformerLayer`` adds one ``[s, b, h]`` residual, so the layer here is a
subclass with its own forward over the same submodules (norms, attention, MLP / MoE, built from the
spec as usual). Between layers the streams travel as ``[s, b, hc_mult * h]``; the first layer
widens the embedding (every stream a copy of it), and ``HyperHead`` stands in for the block's final
norm (collapse, then RMSNorm). The arithmetic is transformers' ``DeepseekV4HyperConnection`` /
``DeepseekV4HyperHead`` op for op, in fp32 as there, and the parameters keep its names.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(torch.nn.Module):
    """The ``(post, comb, collapsed)`` of ``[s, b, n, h]`` streams around one block."""

    def __init__(self, n: int, hidden: int, iters: int, hc_eps: float, norm_eps: float, dtype: torch.dtype):
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = n, iters, hc_eps, norm_eps
        self.fn = torch.nn.Parameter(torch.zeros((2 + n) * n, n * hidden, dtype=dtype))
        self.base = torch.nn.Parameter(torch.zeros((2 + n) * n, dtype=dtype))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=dtype))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.n
        flat = _unweighted_rms(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(*comb_w.shape[:-1], n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def _mix(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The new streams: the block's output spread by ``post`` plus the old streams mixed by ``comb``
    (summed over its first stream axis, as transformers reads it)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@functools.cache  # one class per (streams, iterations, epsilon): models built apart share it
def layer_class(n: int, iters: int, hc_eps: float) -> type:
    """A megatron-core ``TransformerLayer`` carrying ``n`` residual streams."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class HyperLayer(TransformerLayer):
        def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any):
            super().__init__(config, submodules, *args, **kwargs)
            make = functools.partial(HyperConnection, n, config.hidden_size, iters, hc_eps,
                                     config.layernorm_epsilon, config.params_dtype)
            self.attn_hc, self.ffn_hc = make(), make()

        def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, context: Any = None,
                    context_mask: Any = None, rotary_pos_emb: Any = None, *_: Any, **kwargs: Any):
            s, b, width = hidden_states.shape
            h = self.config.hidden_size
            if width == h:  # the embedding: every stream starts as a copy of it
                streams = hidden_states.unsqueeze(2).expand(s, b, n, h)
            else:
                streams = hidden_states.view(s, b, n, h)
            post, comb, x = self.attn_hc(streams)
            out, bias = self.self_attention(self.input_layernorm(x), attention_mask=attention_mask,
                                            rotary_pos_emb=rotary_pos_emb,
                                            packed_seq_params=kwargs.get("packed_seq_params"))
            streams = _mix(streams, out if bias is None else out + bias, post, comb)
            post, comb, x = self.ffn_hc(streams)
            out, bias = self.mlp(self.pre_mlp_layernorm(x))
            streams = _mix(streams, out if bias is None else out + bias, post, comb)
            return streams.reshape(s, b, n * h), context

    HyperLayer.__name__ = HyperLayer.__qualname__ = f"HyperLayer{n}"
    return HyperLayer


def streams_spec(arch: Any, spec: Any) -> Any:
    """A layer spec built as ``layer_class`` over the same submodules."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=layer_class(arch.hc_mult, arch.hc_sinkhorn_iters, arch.hc_eps), submodules=spec.submodules)


@functools.cache
def head_class(n: int, hc_eps: float) -> type:
    """The block's final norm over ``n`` streams: transformers' ``hc_head`` collapse, then RMSNorm
    (its weight keeps the final norm's name, ``weight``)."""

    class HyperHead(torch.nn.Module):
        def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any):
            super().__init__()
            dtype = config.params_dtype
            self.eps, self.hidden = eps, hidden_size
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
            self.hc_fn = torch.nn.Parameter(torch.zeros(n, n * hidden_size, dtype=dtype))
            self.hc_base = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
            self.hc_scale = torch.nn.Parameter(torch.ones(1, dtype=dtype))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            streams = x.view(*x.shape[:-1], n, self.hidden)
            flat = _unweighted_rms(streams.flatten(-2).float(), self.eps)
            pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float()
                                + self.hc_base.float()) + hc_eps
            h = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(x.dtype).float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (self.weight * h).to(x.dtype)

    HyperHead.__name__ = HyperHead.__qualname__ = f"HyperHead{n}"
    return HyperHead
