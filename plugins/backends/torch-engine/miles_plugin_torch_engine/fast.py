"""The fast path's model forward: Llama-family decoders (Llama, Qwen2, Qwen3, Mistral) run straight
from the Hugging Face module's weights over a KV cache preallocated as ``[layers, slots, kv_heads,
max_len, head_dim]`` (on CPU, for long caches, the keys' storage is ``[..., head_dim, max_len]``
seen through a transposed view: see ``cpu_decode``).

One cache row ("slot") per sequence. Prefill runs right-padded prompts with causal SDPA (flash
attention on GPU) and writes each prompt's keys/values into the ``n`` rows of its samples (the
prompt is computed once per group). A decode step feeds one token per active row; rows are kept
packed in ``[0, B)`` by the scheduler, so the step reads plain slices of the cache and has static
shapes per (batch, length) bucket, which is what lets it be captured in a CUDA graph. On CUDA the
decode step (attention included) and the prefill's element-wise steps use the fused Triton
kernels of ``triton_ops`` (about ten kernels a decode layer); on CPU,
and for Qwen3's q/k norms, plain torch ops (the CPU tests hold these to the HF forward at 1e-5).

Weights are read from the module at every call, except q|k|v and gate|up, which are fused into
engine-owned copies refreshed at every ``generate``; ``weights_signature`` lets graph owners
notice re-allocated parameters. Everything else (other architectures, LoRA-wrapped layers,
dynamic RoPE, sliding windows) is refused by :func:`unsupported_reason` and served by the
engine's generic HF path.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from miles_fastpath.llama import llama_layout_problem
from miles_fastpath.ops import rms_norm as _rms

from . import triton_ops

# on CPU, caches of at least this many positions store keys dim-major (``cpu_decode`` says why)
DIM_MAJOR_KEYS = 192
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fast path cannot run ``model`` exactly as its own forward would (None: it can)."""
    return llama_layout_problem(model, SUPPORTED)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with the sign of rotate_half folded into ``sin``
    (``-a * s == a * -s`` exactly): one roll instead of two slices, a negation and a cat."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def _lin(x: torch.Tensor, mod: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, mod.weight, mod.bias)


class RowsForward:
    """What the scheduler (``batching.FastGenerator``) and its graphs read of any forward over
    cache rows: the model's device and dtype, and the addresses of the weights a graph replays."""

    model: torch.nn.Module

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    def weights_signature(self) -> tuple:
        """Storage addresses of every weight read (a CUDA graph holds these addresses)."""
        return tuple(p.data_ptr() for p in self.model.parameters())

    def saved_state(self) -> Callable[[], None] | None:
        """A function that puts back the state a decode step advances in place (None: a step only
        writes what the next one rewrites), for the warm-up run before a graph capture."""
        return None


class LlamaFamilyForward(RowsForward):
    """Prefill and decode of a supported HF model over a preallocated KV cache."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.inner = model.model
        attn = self.inner.layers[0].self_attn
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = attn.q_proj.out_features // self.heads
        self.scale = getattr(attn, "scaling", self.head_dim ** -0.5)
        self.qk_norm = hasattr(attn, "q_norm")  # Qwen3
        self.k_cache = self.v_cache = self.cos = self.sin = None
        self.slots = self.max_len = 0
        self._fused: list[dict[str, Any]] = []
        d = self.head_dim
        # fused Triton kernels for decode on CUDA (not for Qwen3's q/k norms: torch ops there)
        self.use_triton = (triton_ops.available() and self.device.type == "cuda" and not self.qk_norm
                           and d & (d - 1) == 0)
        self._fused_layout: tuple = ()

    def weights_signature(self) -> tuple:
        fused = [t.data_ptr() for f in self._fused for t in f.values() if t is not None]
        return super().weights_signature() + tuple(fused)

    @torch.no_grad()
    def refresh(self) -> None:
        """Fused q|k|v and gate|up weights (one matmul each instead of three and two), copied from
        the module's weights at every ``generate``: one pass over those weights, far cheaper than
        any generation, and right however the weights were replaced (in place, ``.data = ``, or
        a shared segment the trainer writes into)."""
        layers = self.inner.layers
        srcs = [[layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj,
                 layer.mlp.up_proj] for layer in layers]
        layout = (self.dtype, self.device, tuple(m.weight.shape for m in srcs[0]))
        if layout != self._fused_layout:
            self._fused = [{} for _ in layers]  # new buffers; otherwise refill in place (graphs)
            self._fused_layout = layout
        for f, (q, k, v, g, u) in zip(self._fused, srcs):
            self._fill(f, "qkv", [q.weight, k.weight, v.weight])
            self._fill(f, "qkv_bias", [q.bias, k.bias, v.bias] if q.bias is not None else None)
            self._fill(f, "gate_up", [g.weight, u.weight])
            self._fill(f, "gate_up_bias", [g.bias, u.bias] if g.bias is not None else None)

    @staticmethod
    def _fill(fused: dict, key: str, parts: list | None) -> None:
        if parts is None or any(p is None for p in parts):
            fused[key] = None
            return
        if fused.get(key) is None:
            fused[key] = torch.cat(parts)
        else:
            torch.cat(parts, out=fused[key])

    KEEP_BYTES = 256 << 20  # a KV cache above this is sized to each request, not to the largest seen

    def allocate(self, slots: int, max_len: int) -> None:
        """The KV cache (``slots`` rows of ``max_len`` positions) and the RoPE table, once."""
        per_pos = 2 * len(self.inner.layers) * self.kv_heads * self.head_dim * self.dtype.itemsize
        if self.k_cache is not None and slots <= self.slots and max_len <= self.max_len:
            have = self.slots * self.max_len
            # kept unless it is large and mostly idle: one long request must not pin its cache
            if have * per_pos <= self.KEEP_BYTES or have <= 4 * slots * max_len:
                return
        elif self.k_cache is not None and (max(slots, self.slots) * max(max_len, self.max_len) * per_pos
                                           <= self.KEEP_BYTES):
            slots, max_len = max(slots, self.slots), max(max_len, self.max_len)
        self.k_cache = self.v_cache = None  # free the old cache before taking the new one
        shape = (len(self.inner.layers), slots, self.kv_heads, max_len, self.head_dim)
        if self.device.type == "cpu" and max_len >= DIM_MAJOR_KEYS:  # see cpu_decode; seen through a view
            self.k_cache = torch.zeros(shape[:3] + shape[:2:-1], dtype=self.dtype).transpose(3, 4)
        else:
            self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # HF's own rotary module makes the table, so rope_theta / scaling types are taken as they are
        pos = torch.arange(max_len, device=self.device)[None]
        cos, sin = self.inner.rotary_emb(self.k_cache[0, 0, 0, :1], pos)
        half = self.head_dim // 2
        self.cos = cos[0].contiguous()
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)  # see _rope
        self.slots, self.max_len = slots, max_len

    def _qkv(self, li: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             heads_dim: int) -> tuple[torch.Tensor, ...]:
        """Rotated q, k and plain v of layer ``li``, heads on dim ``heads_dim`` of the output."""
        f, H, KV = self._fused[li], self.heads, self.kv_heads
        qkv = F.linear(x, f["qkv"], f["qkv_bias"]).unflatten(-1, (H + 2 * KV, self.head_dim))
        if heads_dim != qkv.dim() - 2:
            qkv = qkv.transpose(heads_dim, qkv.dim() - 2)
        q, k, v = qkv.split([H, KV, KV], dim=heads_dim)
        if self.qk_norm:
            attn = self.inner.layers[li].self_attn
            return _rope(_rms(q, attn.q_norm), cos, sin), _rope(_rms(k, attn.k_norm), cos, sin), v
        qk = _rope(qkv.narrow(heads_dim, 0, H + KV), cos, sin)  # q and k rotated in one go
        return qk.narrow(heads_dim, 0, H), qk.narrow(heads_dim, H, KV), v

    def _mlp(self, li: int, h: torch.Tensor) -> torch.Tensor:
        layer, f = self.inner.layers[li], self._fused[li]
        gate, up = F.linear(_rms(h, layer.post_attention_layernorm), f["gate_up"],
                            f["gate_up_bias"]).chunk(2, dim=-1)
        return h + _lin(F.silu(gate) * up, layer.mlp.down_proj)

    def logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        h = _rms(h, self.inner.norm)
        w = self.model.lm_head.weight
        return torch.mm(h, w.t(), out=out) if out is not None else h @ w.t()

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                repeats: torch.Tensor) -> torch.Tensor:
        """Run right-padded prompts ``ids [P, T]``; write prompt ``i``'s keys/values into cache rows
        ``rows[sum(repeats[:i]) : sum(repeats[:i+1])]``; return the last-token logits ``[P, V]``."""
        if self.use_triton:
            return self._prefill_fused(ids, lengths, rows, repeats)
        P, T = ids.shape
        h = self.inner.embed_tokens(ids)
        cos, sin = self.cos[:T], self.sin[:T]
        for li, layer in enumerate(self.inner.layers):
            q, k, v = self._qkv(li, _rms(h, layer.input_layernorm), cos, sin, heads_dim=1)
            o = self._prefill_attention(li, q, k, v, rows, repeats)
            h = h + _lin(o.transpose(1, 2).reshape(P, T, -1), layer.self_attn.o_proj)
            h = self._mlp(li, h)
        last = h[torch.arange(P, device=h.device), lengths - 1]
        return self.logits(last)

    def _prefill_fused(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                       repeats: torch.Tensor) -> torch.Tensor:
        """``prefill`` with the Triton residual-add + RMSNorm and SiLU-gate kernels over the
        ``P * T`` token rows (the element-wise steps of a layer were ~40% of a 256 x 128 prefill)."""
        P, T = ids.shape
        layers = self.inner.layers
        h = self.inner.embed_tokens(ids).view(P * T, -1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = triton_ops.add_rms_norm(h, None, layers[0].input_layernorm)
        for li in range(len(layers)):
            q, k, v = self._qkv(li, x.view(P, T, -1), cos, sin, heads_dim=1)
            o = self._prefill_attention(li, q, k, v, rows, repeats)
            x = self._fused_rest(li, h, o.transpose(1, 2).reshape(P * T, -1))
        last = x.view(P, T, -1)[torch.arange(P, device=x.device), lengths - 1]
        return last @ self.model.lm_head.weight.t()

    def _prefill_attention(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           rows: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
        """Layer ``li``'s causal attention over right-padded prompts ``[P, heads, T, D]`` (causality
        alone keeps real tokens off the pads: no mask), and the keys/values into the prompts' cache
        rows (``repeats[i]`` rows for prompt ``i``)."""
        T = k.shape[2]
        self.k_cache[li, rows, :, :T] = k.repeat_interleave(repeats, dim=0)
        self.v_cache[li, rows, :, :T] = v.repeat_interleave(repeats, dim=0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                              enable_gqa=self.kv_heads != self.heads)

    def decode(self, tok: torch.Tensor, pos: torch.Tensor, length: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """One token per cache row ``0..B-1`` (``tok``/``pos``: ``[B]``), attending to cache positions
        ``< length`` that are ``<= pos``; returns logits ``[B, V]`` (written into ``out`` if given)."""
        if self.use_triton:
            return self._decode_fused(tok, pos, length, out)
        B = tok.shape[0]
        rows = torch.arange(B, device=tok.device)
        h = self.inner.embed_tokens(tok)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        mask = (torch.arange(length, device=tok.device) <= pos[:, None])[:, None, None]
        group = self.heads // self.kv_heads
        for li, layer in enumerate(self.inner.layers):
            q, k, v = self._qkv(li, _rms(h, layer.input_layernorm), cos, sin, heads_dim=1)
            self.k_cache[li, rows, :, pos] = k
            self.v_cache[li, rows, :, pos] = v
            # the query heads sharing a KV head become that head's query rows (GQA without copies)
            o = F.scaled_dot_product_attention(
                q.reshape(B, self.kv_heads, group, self.head_dim), self.k_cache[li, :B, :, :length],
                self.v_cache[li, :B, :, :length], attn_mask=mask, scale=self.scale)
            h = h + _lin(o.reshape(B, -1), layer.self_attn.o_proj)
            h = self._mlp(li, h)
        return self.logits(h, out)

    def _decode_fused(self, tok: torch.Tensor, pos: torch.Tensor, length: int,
                      out: torch.Tensor | None) -> torch.Tensor:
        """``decode`` with the Triton kernels: about ten kernels a layer instead of thirty-five.
        Attention reads each row's own positions (``pos``), so ``length`` (the graph's bucket)
        does not enter it."""
        B, KV, D = tok.shape[0], self.kv_heads, self.head_dim
        layers = self.inner.layers
        h = self.inner.embed_tokens(tok)
        x = triton_ops.add_rms_norm(h, None, layers[0].input_layernorm)
        for li in range(len(layers)):
            f = self._fused[li]
            qkv = F.linear(x, f["qkv"], f["qkv_bias"]).view(B, self.heads + 2 * KV, D)
            q = triton_ops.rope_store(qkv, self.cos, self.sin, pos, self.k_cache[li], self.v_cache[li],
                                      self.heads, KV)
            o = triton_ops.decode_attention(q, self.k_cache[li], self.v_cache[li], pos, self.scale)
            x = self._fused_rest(li, h, o.reshape(B, -1))
        w = self.model.lm_head.weight
        return torch.mm(x, w.t(), out=out) if out is not None else x @ w.t()

    def _fused_rest(self, li: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Layer ``li`` after attention (``attn [N, H * D]``), with the Triton kernels: o_proj and
        the residual add into ``h`` (in place), the MLP and its residual add, then the next
        layer's input norm (the final norm after the last layer), which is returned."""
        layers, f = self.inner.layers, self._fused[li]
        layer = layers[li]
        x = triton_ops.add_rms_norm(h, _lin(attn, layer.self_attn.o_proj), layer.post_attention_layernorm)
        act = triton_ops.silu_mul(F.linear(x, f["gate_up"], f["gate_up_bias"]))
        norm = layers[li + 1].input_layernorm if li + 1 < len(layers) else self.inner.norm
        return triton_ops.add_rms_norm(h, _lin(act, layer.mlp.down_proj), norm)

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Copy cache rows ``src`` onto ``dst`` (positions ``< length``): keeps live rows packed."""
        self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
        self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]
