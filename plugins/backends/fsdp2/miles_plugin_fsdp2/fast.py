"""The trainer's log-prob forward for Llama-family decoders (Llama, Qwen2, Mistral): run straight
from the Hugging Face module's weights, differentiably, over one flat ``[tokens, hidden]`` tensor.

The same ops as the module's own forward, in the same order (on CPU the log-probs come out bit for
bit equal to it where the GEMM library rounds a row the same whatever the call's row count, as MKL
did on an AVX2 host; on AVX-512 MKL picks kernels by row count: about an ulp apart), without what
the generic path spends besides the matmuls: the KV-cache object and its per-layer copies, the
``repeat_kv`` copies of every key/value head and their backward sums, the slices, negation and
concatenation of each rotary embedding, and a second forward call.

With a small vocabulary (character tokenizers: at most ``TABLE_SHARE`` of the batch's tokens),
layer 0's q, k and v are looked up in a table made over the vocabulary, as the torch engine does
in decode: that layer's first norm and projections see each token id once instead of every
position (the same values up to GEMM rounding; the embedding's padding row still gets no
gradient). A 6-layer hidden-256 model over 14 ids: a training step 2-4% faster.

The GEMMs by the weights run in torch (MKL) or, as ``trainer.cpu_gemm`` picks, in oneDNN
(``miles_fastpath.cpu_gemm.trainable_linear``: forward and input gradient; AMD CPUs, layers of >= 512k
weights): a 6-layer hidden-256 model's GRPO step 1.19x faster on an AMD EPYC host (the
log-probs then round as oneDNN's GEMMs do, within the tests' tolerance of HF's forward).

Token layout: the prompt of each run of rows sharing it (``runs``), once (``G * P`` tokens), then
every row's response inputs (``B * (R - 1)``). Norms, projections and the MLP see all tokens in
one matmul each; attention splits them: prompts attend causally among themselves (left padding
masked), responses attend to their run's prompt and causally to their own tokens.

Anything else (other architectures, FSDP2-wrapped or LoRA-wrapped modules, Qwen3's q/k norms,
sliding windows, dynamic RoPE, packed rows) is refused by :func:`usable` and runs the HF forward.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from miles_fastpath import cpu_gemm
from miles_fastpath.llama import llama_layout_problem
from miles_fastpath.ops import rms_norm as _rms

TABLE_SHARE = 0.5  # layer 0's q|k|v tabled per token id when the vocabulary is at most this share of the tokens

# exact class names: FSDP2's fully_shard swaps in an "FSDP..." subclass, whose hooks gather the
# sharded weights this path would bypass
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def usable(model: torch.nn.Module, batch: Any) -> bool:
    """Whether :func:`response_logits` computes what the module's own forward would. CPU only:
    it was built and checked against the HF path there; on GPU the HF path keeps its fused
    attention kernels and mixed-precision casts."""
    return (not batch.input_ids.is_cuda and batch.attention_mask.dim() == 2 and batch.prompt_len >= 1
            and unsupported_reason(model) is None)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this path cannot run ``model`` as its own forward would (None: it can)."""
    if model.training and getattr(model.config, "attention_dropout", 0.0):
        return "attention dropout"
    layers = getattr(getattr(model, "model", None), "layers", [])
    # a linear-attention layer (Qwen3-Next's gated DeltaNet) has no self_attn: the layout check refuses it
    if any(hasattr(getattr(layer, "self_attn", None), "q_norm") for layer in layers):
        return "q/k norms (Qwen3)"
    return llama_layout_problem(model, SUPPORTED)


class _Plan:
    """One batch's bookkeeping: the flat token layout, the RoPE tables and the attention masks."""

    def __init__(self, model: torch.nn.Module, batch: Any, runs: list[int], rep: int, gemm: str):
        # the GEMMs by the weights: torch's (MKL) or oneDNN's (``miles_fastpath.cpu_gemm``)
        self.linear = cpu_gemm.trainable_linear if gemm == "onednn" else F.linear
        ids, pos = batch.input_ids, batch.position_ids
        self.P, L = batch.prompt_len, ids.shape[1]
        self.B, self.G, self.R1 = ids.shape[0], len(runs), L - 1 - batch.prompt_len
        P, n = self.P, runs[0]
        if all(r == n for r in runs):
            first, self.reps = slice(None, None, n), n  # each run's first row
        else:
            first = torch.tensor([0, *itertools.accumulate(runs)][:-1], device=ids.device)
            self.reps = torch.tensor(runs, device=ids.device)
        self.Tp = self.G * P
        self.tokens = torch.cat([ids[first, :P].reshape(-1), ids[:, P:L - 1].reshape(-1)])
        positions = torch.cat([pos[first, :P].reshape(-1), pos[:, P:L - 1].reshape(-1)])
        # HF's own rotary module makes the table, so rope_theta / scaling types are taken as they are
        cos, sin = model.model.rotary_emb(model.lm_head.weight[:1], positions[None])
        half = cos.shape[-1] // 2
        self.cos = cos[0, :, None]  # [T, 1, D]
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)[:, None]
        self._masks(batch.attention_mask[first, :P].bool(), batch.attention_mask[:, P:L - 1].bool(), rep)

    def _masks(self, prompt_ok: torch.Tensor, resp_ok: torch.Tensor, rep: int) -> None:
        """Boolean masks (True: attend) from the padding of the prompts ``prompt_ok [G, P]`` and of
        the response inputs ``resp_ok [B, R1]``, as the HF forward masks keys."""
        P, R1, dev = self.P, self.R1, prompt_ok.device
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        eye = torch.eye(P, dtype=torch.bool, device=dev)  # a pad query sees itself: no all-masked row
        # None: no padding, plain causal (HF's choice too, so the roundings agree)
        self.prompt_mask = None if bool(prompt_ok.all()) else ((causal & prompt_ok[:, None, :]) | eye)[:, None]
        own = torch.ones(R1, R1, dtype=torch.bool, device=dev).tril()
        if bool(prompt_ok.all()) and bool(resp_ok.all()):
            mask = torch.cat([torch.ones(R1, P, dtype=torch.bool, device=dev), own], 1)  # [R1, P + R1]
        else:  # [B, 1, R1, P + R1]; padding keys matter only to padding queries, but as in HF
            keys = torch.cat([self.expand(prompt_ok), resp_ok], 1)[:, None, :]
            mask = (keys & torch.cat([torch.ones(R1, P, dtype=torch.bool, device=dev), own], 1))[:, None]
        # the query rows of the ``rep`` heads sharing a KV head follow one another (see _attention)
        self.resp_mask = mask.repeat(*([1] * (mask.dim() - 2)), rep, 1)

    def lin(self, x: torch.Tensor, mod: torch.nn.Linear) -> torch.Tensor:
        return self.linear(x, mod.weight, mod.bias)

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """Per-run rows ``[G, ...]`` -> per-sample rows ``[B, ...]``."""
        return x.repeat_interleave(self.reps, dim=0)


def _attention(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``[T, heads * D]`` attention output of every token from rotated ``q [T, heads, D]``,
    ``k`` and ``v [T, kv_heads, D]``."""
    G, B, P, R1, Tp = plan.G, plan.B, plan.P, plan.R1, plan.Tp
    heads, kv_heads, D = q.shape[1], k.shape[1], q.shape[2]
    rep = heads // kv_heads
    kp = k[:Tp].view(G, P, kv_heads, D).transpose(1, 2)
    vp = v[:Tp].view(G, P, kv_heads, D).transpose(1, 2)
    qp = q[:Tp].view(G, P, heads, D).transpose(1, 2)
    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=plan.prompt_mask, scale=scale,
                                        is_causal=plan.prompt_mask is None, enable_gqa=rep > 1)
    op = op.transpose(1, 2).reshape(Tp, heads * D)
    if R1 == 0:
        return op
    keys = torch.cat([plan.expand(kp), k[Tp:].view(B, R1, kv_heads, D).transpose(1, 2)], dim=2)
    values = torch.cat([plan.expand(vp), v[Tp:].view(B, R1, kv_heads, D).transpose(1, 2)], dim=2)
    # the query heads sharing a KV head become that head's query rows (GQA without copies)
    qr = q[Tp:].view(B, R1, heads, D).transpose(1, 2).reshape(B, kv_heads, rep * R1, D)
    orr = F.scaled_dot_product_attention(qr, keys, values, attn_mask=plan.resp_mask, scale=scale)
    return torch.cat([op, orr.view(B, heads, R1, D).transpose(1, 2).reshape(B * R1, heads * D)])


def _tabled_qkv(plan: _Plan, layer: Any, embed: torch.nn.Embedding) -> list[torch.Tensor]:
    """The first layer's q, k, v of each token, from a table over the vocabulary."""
    w = embed.weight
    if embed.padding_idx is not None:  # as nn.Embedding: no gradient into the padding row
        pad = torch.arange(w.shape[0], device=w.device) == embed.padding_idx % w.shape[0]
        w = torch.where(pad[:, None], w.detach(), w)
    h = _rms(w, layer.input_layernorm)
    sa = layer.self_attn
    return [F.embedding(plan.tokens, plan.lin(h, m)) for m in (sa.q_proj, sa.k_proj, sa.v_proj)]


def _layer(plan: _Plan, layer: Any, x: torch.Tensor, heads: int, kv_heads: int, D: int,
           scale: float, qkv: list[torch.Tensor] | None = None) -> torch.Tensor:
    T, sa, mlp = x.shape[0], layer.self_attn, layer.mlp
    if qkv is None:
        h = _rms(x, layer.input_layernorm)
        qkv = [plan.lin(h, sa.q_proj), plan.lin(h, sa.k_proj), plan.lin(h, sa.v_proj)]
    q, k, v = qkv
    # HF's x * cos + rotate_half(x) * sin, the sign of rotate_half folded into the sin table
    # (-a * s == a * -s exactly): one roll instead of two slices, a negation and a cat
    q, k = ((t.view(T, -1, D) * plan.cos + torch.roll(t.view(T, -1, D), D // 2, dims=-1) * plan.sin)
            for t in (q, k))
    x = x + plan.lin(_attention(plan, q, k, v.view(T, kv_heads, D), scale), sa.o_proj)
    h = _rms(x, layer.post_attention_layernorm)
    return x + plan.lin(F.silu(plan.lin(h, mlp.gate_proj)) * plan.lin(h, mlp.up_proj), mlp.down_proj)


def response_logits(model: torch.nn.Module, batch: Any, runs: list[int], gemm: str = "mkl") -> torch.Tensor:
    """``[B, R, V]`` logits predicting each response token; ``runs``: lengths of the runs of
    consecutive rows sharing a prompt (all 1: every row runs its own prompt); ``gemm``: ``mkl``
    (torch's own GEMMs) or ``onednn`` (``miles_fastpath.cpu_gemm``)."""
    inner, cfg = model.model, model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    attn0 = inner.layers[0].self_attn
    D = attn0.q_proj.out_features // heads
    plan = _Plan(model, batch, runs, heads // kv_heads, gemm)
    embed = inner.embed_tokens
    x = embed(plan.tokens)
    qkv = (_tabled_qkv(plan, inner.layers[0], embed)
           if embed.num_embeddings <= TABLE_SHARE * len(plan.tokens) else None)
    for i, layer in enumerate(inner.layers):
        x = _layer(plan, layer, x, heads, kv_heads, D, getattr(layer.self_attn, "scaling", D ** -0.5),
                   qkv if i == 0 else None)
    P, Tp, w = plan.P, plan.Tp, model.lm_head.weight
    # two matmuls, as the HF path makes them (one over all rows rounds the first token differently)
    first = plan.linear(_rms(x[P - 1:Tp:P], inner.norm), w, None).float()  # each run's last prompt token
    first = plan.expand(first)[:, None]  # predicts response token 0
    if plan.R1 == 0:
        return first
    rest = plan.linear(_rms(x[Tp:], inner.norm), w, None).float().view(plan.B, plan.R1, -1)
    return torch.cat([first, rest], dim=1)
