"""Hugging Face <-> megatron-core weights for the local-spec ``GPTModel`` (Llama, Qwen2, Qwen3,
Qwen3-MoE, and families described by their architecture plugin: DeepSeek-V3's multi-latent
attention, shared experts, expert bias, dense layers among MoE ones; gpt-oss' attention sinks,
biases and interleaved experts; DeepSeek-V4's hyper-connections, hash tables and held attention),
as pure functions over state dicts so they run (and are tested) without a GPU.

Three layers of layout:
* *HF*: the transformers model's own ``state_dict`` names (fused ``mlp.experts.gate_up_proj``
  ``[E, 2I, H]`` in transformers 5, per-expert ``gate_proj``/``up_proj`` before it; both read;
  gpt-oss' ``[E, H, 2I]`` with gate and up columns alternating).
* *full Megatron*: the names and shapes of a TP=1, EP=1 model: ``linear_qkv`` holds, per KV
  group, that group's query heads then its key head then its value head; ``linear_fc1`` is
  ``[gate; up]``; the vocabulary is padded to a multiple of the TP size; experts use global indices.
* *shard*: one (TP rank, EP rank)'s tensors, cut from the full ones by ``shard``/``unshard``.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from . import convert_gated as gated
from .arch import Arch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
# TP dimension of each (non-replicated) Megatron weight: column-parallel 0, row-parallel 1
_TP_DIM = {"self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
           "self_attention.linear_proj.weight": 1, "mlp.linear_fc1.weight": 0, "mlp.linear_fc2.weight": 1,
           "linear_fc1.weight": 0, "linear_fc2.weight": 1,
           # multi-latent attention: every projection column-parallel (megatron-core gathers the
           # down-projections' outputs), its latent norms replicated
           "self_attention.linear_q_proj.weight": 0, "self_attention.linear_q_down_proj.weight": 0,
           "self_attention.linear_q_up_proj.weight": 0, "self_attention.linear_kv_down_proj.weight": 0,
           "self_attention.linear_kv_up_proj.weight": 0,
           "mlp.shared_experts.linear_fc1.weight": 0, "mlp.shared_experts.linear_fc2.weight": 1,
           # learned attention sinks: one per query head, split as the heads are
           "self_attention.core_attention.softmax_offset": 0, "linear_fc1.bias": 0, "mlp.linear_fc1.bias": 0,
           # DeepSeek-V4's held attention, split by head (its parts all heads share stay whole)
           "self_attention.hf.q_b_proj.weight": 0, "self_attention.hf.sinks": 0,
           "self_attention.hf.o_a_proj.weight": 0, "self_attention.hf.o_b_proj.weight": 1}
_TP_DIM.update(gated.TP_DIM)  # gated DeltaNet (convert_gated.py)
# multi-latent attention: Megatron name -> HF name under ``self_attn.``
_MLA = {"linear_q_proj.weight": "q_proj.weight", "linear_q_down_proj.weight": "q_a_proj.weight",
        "q_layernorm.weight": "q_a_layernorm.weight", "linear_q_up_proj.weight": "q_b_proj.weight",
        "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight", "kv_layernorm.weight": "kv_a_layernorm.weight",
        "linear_kv_up_proj.weight": "kv_b_proj.weight",
        # DeepSeek sparse attention's indexer (GLM-5), replicated on every TP rank
        "core_attention.indexer.linear_wq_b.weight": "indexer.wq_b.weight",
        "core_attention.indexer.linear_wk.weight": "indexer.wk.weight",
        "core_attention.indexer.k_norm.weight": "indexer.k_norm.weight",
        "core_attention.indexer.k_norm.bias": "indexer.k_norm.bias",
        "core_attention.indexer.linear_weights_proj.weight": "indexer.weights_proj.weight"}


# -- HF <-> full Megatron ----------------------------------------------------------------------------
def _qkv(arch: Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = arch.kv_heads, arch.head_dim
    per = arch.heads // g
    rest = q.shape[1:]
    parts = [q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(parts, dim=1).reshape(g * (per + 2) * d, *rest)


def _unqkv(arch: Arch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = arch.kv_heads, arch.head_dim
    per = arch.heads // g
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
    return (q.reshape(g * per * d, *rest).clone(), k.reshape(g * d, *rest).clone(),
            v.reshape(g * d, *rest).clone())


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def hf_to_full(hf: dict[str, torch.Tensor], arch: Arch, tp: int = 1) -> dict[str, torch.Tensor]:
    """Full Megatron tensors (vocabulary padded for ``tp``) from a HF state dict."""
    V = arch.padded_vocab(tp)
    out = {"embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], V),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not arch.tied:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], V)
    if arch.hc_mult > 1:  # the hyper-connection head sits in the final norm (hyper.py)
        out.update({f"decoder.final_layernorm.{k[14:]}": t for k, t in hf.items() if k.startswith("model.hc_head.")})
    for i in range(arch.num_layers):
        out.update({f"decoder.layers.{i}.{k}": t for k, t in _layer_to_mcore(hf, arch, i).items()})
    return out


def _layer_to_mcore(hf: dict[str, torch.Tensor], arch: Arch, i: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out = {"input_layernorm.weight": hf[p + "input_layernorm.weight"],
           "pre_mlp_layernorm.weight": hf[p + "post_attention_layernorm.weight"]}
    if arch.hc_mult > 1:  # the layer's hyper-connections, under their own names
        out.update({k[len(p):]: t for k, t in hf.items() if k.startswith((p + "attn_hc.", p + "ffn_hc."))})
    if i in arch.linear_layers:  # gated DeltaNet in place of attention
        out.update(gated.delta_to_mcore(hf, arch, p + "linear_attn."))
    else:
        out.update(_attention_to_mcore(hf, arch, a))
    m = p + "mlp."
    if not arch.moe_layer(i):
        out["mlp.linear_fc1.weight"] = torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
        out["mlp.linear_fc2.weight"] = hf[m + "down_proj.weight"]
        return out
    r = f"{m}{arch.hf_router}."
    out["mlp.router.weight"] = hf[r + "weight"]
    if arch.linear_bias:
        out["mlp.router.bias"] = hf[r + "bias"]
    if i in arch.hash_layers:  # the token-id table picks the experts; no selection bias
        out["mlp.router.tid2eid"] = hf[r + "tid2eid"]
    elif arch.expert_bias:
        out["mlp.router.expert_bias"] = hf[r + "e_score_correction_bias"]
    if arch.shared_ffn:
        s = f"{m}{arch.shared_hf}."
        out["mlp.shared_experts.linear_fc1.weight"] = torch.cat([hf[s + "gate_proj.weight"],
                                                                 hf[s + "up_proj.weight"]])
        out["mlp.shared_experts.linear_fc2.weight"] = hf[s + "down_proj.weight"]
        if arch.shared_gate:
            out["mlp.shared_experts.gate_weight"] = hf[m + "shared_expert_gate.weight"]
    if arch.hf_experts == "interleaved":
        out.update(_interleaved_to_mcore(hf, arch, m))
        return out
    fused = m + "experts.gate_up_proj" in hf
    for e in range(arch.experts):
        x = f"mlp.experts.local_experts.{e}."
        if fused:  # transformers 5: gate_up_proj[e] is already [gate; up] over [out, in]
            out[x + "linear_fc1.weight"] = hf[m + "experts.gate_up_proj"][e].clone()
            out[x + "linear_fc2.weight"] = hf[m + "experts.down_proj"][e].clone()
        else:
            q = f"{m}experts.{e}."
            out[x + "linear_fc1.weight"] = torch.cat([hf[q + "gate_proj.weight"], hf[q + "up_proj.weight"]])
            out[x + "linear_fc2.weight"] = hf[q + "down_proj.weight"]
    return out


def _interleaved_to_mcore(hf: dict[str, torch.Tensor], arch: Arch, m: str) -> dict[str, torch.Tensor]:
    """gpt-oss' experts: ``gate_up_proj[e]`` is ``[in, 2I]`` with gate and up columns alternating,
    ``down_proj[e]`` ``[I, out]``, each with a bias."""
    out = {}
    gate_up, gate_up_bias = hf[m + "experts.gate_up_proj"], hf[m + "experts.gate_up_proj_bias"]
    for e in range(arch.experts):
        x = f"mlp.experts.local_experts.{e}."
        out[x + "linear_fc1.weight"] = torch.cat([gate_up[e][:, 0::2].t(), gate_up[e][:, 1::2].t()]).contiguous()
        out[x + "linear_fc1.bias"] = torch.cat([gate_up_bias[e][0::2], gate_up_bias[e][1::2]])
        out[x + "linear_fc2.weight"] = hf[m + "experts.down_proj"][e].t().contiguous()
        out[x + "linear_fc2.bias"] = hf[m + "experts.down_proj_bias"][e].clone()
    return out


def _interleaved_to_hf(experts: dict[int, dict[str, torch.Tensor]], arch: Arch, m: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`_interleaved_to_mcore`."""
    def alternate(fc1: torch.Tensor) -> torch.Tensor:  # [2I, ...] = [gate; up] -> rows gate, up, gate, ...
        gate, up = fc1.chunk(2)
        return torch.stack([gate, up], dim=1).reshape(fc1.shape)

    got = [experts[e] for e in range(arch.experts)]
    return {m + "experts.gate_up_proj": torch.stack([alternate(x["linear_fc1.weight"]).t() for x in got]),
            m + "experts.gate_up_proj_bias": torch.stack([alternate(x["linear_fc1.bias"]) for x in got]),
            m + "experts.down_proj": torch.stack([x["linear_fc2.weight"].t() for x in got]),
            m + "experts.down_proj_bias": torch.stack([x["linear_fc2.bias"] for x in got])}


def _attention_to_mcore(hf: dict[str, torch.Tensor], arch: Arch, a: str) -> dict[str, torch.Tensor]:
    """A softmax-attention layer's ``self_attention.*`` tensors (HF names under ``a``)."""
    if arch.hf_attention:  # transformers' own module, held as ``self_attention.hf``
        return {f"self_attention.hf.{k[len(a):]}": t for k, t in hf.items() if k.startswith(a)}
    out = {"self_attention.linear_proj.weight": hf[a + "o_proj.weight"]}
    if arch.mla:
        out.update({f"self_attention.{m}": hf[a + h] for m, h in _MLA.items() if a + h in hf})
    elif arch.attention_gate:
        out["self_attention.linear_qkv.weight"] = gated.gated_qkv(arch, hf[a + "q_proj.weight"],
                                                                  hf[a + "k_proj.weight"], hf[a + "v_proj.weight"])
    else:
        out["self_attention.linear_qkv.weight"] = _qkv(arch, hf[a + "q_proj.weight"], hf[a + "k_proj.weight"],
                                                       hf[a + "v_proj.weight"])
    if arch.qkv_bias:
        out["self_attention.linear_qkv.bias"] = _qkv(arch, hf[a + "q_proj.bias"], hf[a + "k_proj.bias"],
                                                     hf[a + "v_proj.bias"])
    if arch.linear_bias:
        out["self_attention.linear_proj.bias"] = hf[a + "o_proj.bias"]
    if arch.sinks:
        out["self_attention.core_attention.softmax_offset"] = hf[a + "sinks"]
    if arch.qk_norm:
        out["self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
        out["self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
    return out


def full_to_hf(full: dict[str, torch.Tensor], arch: Arch, fused_experts: bool = True) -> dict[str, torch.Tensor]:
    """HF tensors from full Megatron ones. Any subset that holds whole layers converts (a layer's
    tensors, with all of its experts, at a time: the unit the trainer streams weights in)."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in full.items():
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t[:arch.vocab]
            if arch.tied:  # transformers' state dict names the shared matrix twice
                out["lm_head.weight"] = out["model.embed_tokens.weight"]
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t[:arch.vocab]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif name.startswith("decoder.final_layernorm.hc_"):
            out["model.hc_head." + name[24:]] = t
        elif (hit := _LAYER.match(name)) is not None:
            layers.setdefault(int(hit[1]), {})[hit[2]] = t
        elif not name.endswith("_extra_state"):
            raise KeyError(f"no Hugging Face name for Megatron weight {name!r}")
    for i, parts in sorted(layers.items()):
        out.update(_layer_to_hf(parts, arch, i, fused_experts))
    return out


def _layer_to_hf(mc: dict[str, torch.Tensor], arch: Arch, i: int, fused: bool) -> dict[str, torch.Tensor]:
    p, out = f"model.layers.{i}.", {}
    a, m = p + "self_attn.", p + "mlp."
    experts: dict[int, dict[str, torch.Tensor]] = {}
    delta: dict[str, torch.Tensor] = {}
    for name, t in mc.items():
        if i in arch.linear_layers and name.startswith("self_attention."):
            delta[name[15:]] = t
        elif arch.hf_attention and name.startswith("self_attention.hf."):
            out[a + name[18:]] = t
        elif name.startswith(("attn_hc.", "ffn_hc.")):
            out[p + name] = t
        elif arch.attention_gate and name == "self_attention.linear_qkv.weight":
            for proj, x in zip("qkv", gated.ungated_qkv(arch, t)):
                out[f"{a}{proj}_proj.weight"] = x
        elif name == "self_attention.linear_qkv.weight" or name == "self_attention.linear_qkv.bias":
            kind = name.rsplit(".", 1)[1]
            for proj, x in zip("qkv", _unqkv(arch, t)):
                out[f"{a}{proj}_proj.{kind}"] = x
        elif name in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
            q = m if name == "mlp.linear_fc1.weight" else f"{m}{arch.shared_hf}."
            out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = (x.clone() for x in t.chunk(2))
        elif arch.mla and name.startswith("self_attention.") and name[15:] in _MLA:
            out[a + _MLA[name[15:]]] = t
        elif (hit := _EXPERT.match(name)) is not None:
            experts.setdefault(int(hit[1]), {})[hit[2]] = t
        elif name.startswith("mlp.router."):  # weight, bias, and the selection bias under its HF name
            out[f"{m}{arch.hf_router}.{_ROUTER.get(name[11:], name[11:])}"] = t
        elif name == "self_attention.linear_proj.bias":
            out[a + "o_proj.bias"] = t
        elif name == "self_attention.core_attention.softmax_offset":
            out[a + "sinks"] = t
        elif name == "mlp.shared_experts.linear_fc2.weight":
            out[f"{m}{arch.shared_hf}.down_proj.weight"] = t
        elif name == "mlp.shared_experts.gate_weight":
            out[m + "shared_expert_gate.weight"] = t
        elif name in _SIMPLE:
            out[p + _SIMPLE[name]] = t
        elif not name.endswith("_extra_state"):
            raise KeyError(f"no Hugging Face name for Megatron weight decoder.layers.{i}.{name}")
    if delta:
        out.update(gated.delta_to_hf(delta, arch, p + "linear_attn."))
    if experts:
        if len(experts) != arch.experts:
            raise KeyError(f"layer {i}: {len(experts)} of {arch.experts} experts given; convert a "
                           f"layer with all of its experts")
        if arch.hf_experts == "interleaved":
            out.update(_interleaved_to_hf(experts, arch, m))
            return out
        fc1 = [experts[e]["linear_fc1.weight"] for e in range(arch.experts)]
        fc2 = [experts[e]["linear_fc2.weight"] for e in range(arch.experts)]
        if fused:
            out[m + "experts.gate_up_proj"], out[m + "experts.down_proj"] = torch.stack(fc1), torch.stack(fc2)
        else:
            for e in range(arch.experts):
                g, u = fc1[e].chunk(2)
                out.update({f"{m}experts.{e}.gate_proj.weight": g.clone(),
                            f"{m}experts.{e}.up_proj.weight": u.clone(),
                            f"{m}experts.{e}.down_proj.weight": fc2[e]})
    return out


_SIMPLE = {"input_layernorm.weight": "input_layernorm.weight",
           "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
           "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
           "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
           "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
           "mlp.linear_fc2.weight": "mlp.down_proj.weight",
           "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight"}


_ROUTER = {"expert_bias": "e_score_correction_bias"}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def repad_vocab(full: dict[str, torch.Tensor], arch: Arch, tp: int | None) -> dict[str, torch.Tensor]:
    """The vocabulary rows of full tensors padded for ``tp`` ranks (None: cut to the real vocabulary,
    the TP-independent form checkpoints store)."""
    rows = arch.vocab if tp is None else arch.padded_vocab(tp)
    return {k: (_pad_rows(v[:arch.vocab], rows) if k in _VOCAB else v) for k, v in full.items()}


# -- full Megatron <-> one rank's shard ----------------------------------------------------------------
def tp_dim(name: str, arch: Arch | None = None) -> int | None:
    """The dimension a weight is split along across TP ranks; None = replicated (an expert's too
    where ``arch`` keeps its experts whole, ``Arch.expert_tp``)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    hit = _LAYER.match(name)
    if hit is None:
        return None
    rest = hit[2]
    if (e := _EXPERT.match(rest)) is not None:
        if arch is not None and arch.whole_experts:
            return None
        rest = e[2]
    return _TP_DIM.get(rest)


def _is_fc1(name: str) -> bool:
    return name.endswith(("linear_fc1.weight", "linear_fc1.bias"))


def tp_split(name: str, full: torch.Tensor, tp: int, arch: Arch | None = None) -> list[torch.Tensor]:
    """The ``tp`` shards of one full Megatron weight, as TP ranks 0..tp-1 hold them. A gated
    ``linear_fc1`` shard is ``[gate_r; up_r]`` (each rank computes its own SwiGLU slice), and a
    DeltaNet's ``in_proj`` / ``conv1d`` one holds its slice of each part (``arch`` sizes them)."""
    dim = tp_dim(name, arch)
    if dim is None or tp == 1:
        return [full] * tp if dim is None else [full]
    if (parts := gated.tp_parts(name, arch) if arch is not None and arch.linear_layers else None):
        return gated.split_parts(full, parts, tp)
    if _is_fc1(name):
        gate, up = full.chunk(2)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    return [x.clone() for x in full.chunk(tp, dim=dim)]


def tp_merge(name: str, shards: list[torch.Tensor], arch: Arch | None = None) -> torch.Tensor:
    """Inverse of :func:`tp_split`."""
    dim = tp_dim(name, arch)
    if dim is None or len(shards) == 1:
        return shards[0]
    if (parts := gated.tp_parts(name, arch) if arch is not None and arch.linear_layers else None):
        return gated.merge_parts(shards, parts)
    if _is_fc1(name):
        pairs = [s.chunk(2) for s in shards]
        return torch.cat([torch.cat([g for g, _ in pairs]), torch.cat([u for _, u in pairs])])
    return torch.cat(shards, dim=dim)


def expert_local(name: str, arch: Arch, ep: int, ep_rank: int) -> str | None:
    """A full (global expert index) name as EP rank ``ep_rank`` calls it; None = not its expert."""
    hit = _LAYER.match(name)
    e = _EXPERT.match(hit[2]) if hit else None
    if e is None:
        return name
    per = arch.experts // ep
    g = int(e[1])
    if g // per != ep_rank:
        return None
    return f"decoder.layers.{hit[1]}.mlp.experts.local_experts.{g % per}.{e[2]}"


def expert_global(name: str, arch: Arch, ep: int, ep_rank: int) -> str:
    """Inverse of :func:`expert_local`."""
    hit = _LAYER.match(name)
    e = _EXPERT.match(hit[2]) if hit else None
    if e is None:
        return name
    g = ep_rank * (arch.experts // ep) + int(e[1])
    return f"decoder.layers.{hit[1]}.mlp.experts.local_experts.{g}.{e[2]}"


def shard(full: dict[str, torch.Tensor], arch: Arch, *, tp: int = 1, tp_rank: int = 0, ep: int = 1,
          ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """One rank's Megatron state dict (local names) from full Megatron tensors."""
    out = {}
    for name, t in full.items():
        local = expert_local(name, arch, ep, ep_rank)
        if local is not None:
            out[local] = tp_split(name, t, tp, arch)[tp_rank]
    return out


def unshard(shards: dict[tuple[int, int], dict[str, torch.Tensor]], arch: Arch, tp: int = 1,
            ep: int = 1) -> dict[str, torch.Tensor]:
    """Full Megatron tensors from every ``(tp_rank, ep_rank)``'s local state dict."""
    out: dict[str, torch.Tensor] = {}
    for r in range(ep):
        for local in shards[(0, r)]:
            name = expert_global(local, arch, ep, r)
            if name not in out:
                out[name] = tp_merge(name, [shards[(t, r)][local] for t in range(tp)], arch)
    return out


def layer_groups(names: Iterable[str]) -> list[list[str]]:
    """Names grouped into conversion units: each decoder layer, then the rest one by one."""
    groups: dict[str, list[str]] = {}
    for n in names:
        hit = _LAYER.match(n)
        groups.setdefault(f"layer{hit[1]}" if hit else n, []).append(n)
    return list(groups.values())
