"""Hugging Face <-> megatron-core weights of Qwen3-Next's and Qwen3.5's gated layers, beside
``convert.py`` (which calls these):

* gated full attention: HF's ``q_proj`` holds, per head, its query rows then its output-gate rows;
  megatron-core's ``linear_qkv`` with ``attention_output_gate`` holds, per KV group, the group's
  queries, their gates, its key head and its value head.
* gated DeltaNet linear attention, as megatron-core's ``GatedDeltaNet`` names and lays it out:
  ``in_proj`` is ``[q; k; v; z; b; a]`` with every head of a kind together (Qwen3.5 stores it
  so, split in four; Qwen3-Next packs ``in_proj_qkvz`` and ``in_proj_ba`` per key head), and a
  tensor-parallel rank holds each of the six parts' slice in that order; ``conv1d`` runs over
  ``[q; k; v]``, cut the same way; ``dt_bias`` and ``A_log`` per value head; ``out_norm`` (the gated
  RMSNorm over one head) replicated; ``out_proj`` row-parallel.
"""
from __future__ import annotations

import torch

from .arch import Arch

# the DeltaNet's Megatron names (under ``self_attention.``) and their HF names (under ``linear_attn.``)
DELTA = {"conv1d.weight": "conv1d.weight", "dt_bias": "dt_bias", "A_log": "A_log",
         "out_norm.weight": "norm.weight", "out_proj.weight": "out_proj.weight"}
TP_DIM = {"self_attention.in_proj.weight": 0, "self_attention.conv1d.weight": 0, "self_attention.dt_bias": 0,
          "self_attention.A_log": 0, "self_attention.out_proj.weight": 1}


def _sizes(arch: Arch) -> tuple[int, int, int, int]:
    """Query/key width, value width, key heads, value heads per key head."""
    return (arch.linear_key_heads * arch.linear_key_dim, arch.linear_value_heads * arch.linear_value_dim,
            arch.linear_key_heads, arch.linear_value_heads // arch.linear_key_heads)


def tp_parts(name: str, arch: Arch) -> list[int] | None:
    """The parts a tensor-parallel rank holds a slice of each of, in order (None: one part)."""
    qk, v, _, _ = _sizes(arch)
    if name.endswith("self_attention.in_proj.weight"):
        return [qk, qk, v, v, arch.linear_value_heads, arch.linear_value_heads]
    if name.endswith("self_attention.conv1d.weight"):
        return [qk, qk, v]
    return None


def split_parts(full: torch.Tensor, parts: list[int], tp: int) -> list[torch.Tensor]:
    chunks = [p.chunk(tp) for p in full.split(parts)]
    return [torch.cat([c[r] for c in chunks]) for r in range(tp)]


def merge_parts(shards: list[torch.Tensor], parts: list[int]) -> torch.Tensor:
    local = [p // len(shards) for p in parts]
    pieces = [s.split(local) for s in shards]
    return torch.cat([torch.cat([pc[j] for pc in pieces]) for j in range(len(parts))])


# -- gated attention ---------------------------------------------------------------------------------
def gated_qkv(arch: Arch, q_proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = arch.kv_heads, arch.head_dim
    per = arch.heads // g
    rest = q_proj.shape[1:]
    both = q_proj.reshape(arch.heads, 2, d, *rest)
    parts = [both[:, 0].reshape(g, per * d, *rest), both[:, 1].reshape(g, per * d, *rest),
             k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(parts, dim=1).reshape(g * (2 * per + 2) * d, *rest)


def ungated_qkv(arch: Arch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = arch.kv_heads, arch.head_dim
    per = arch.heads // g
    rest = qkv.shape[1:]
    q, gate, k, v = qkv.reshape(g, (2 * per + 2) * d, *rest).split([per * d, per * d, d, d], dim=1)
    q_proj = torch.stack([q.reshape(arch.heads, d, *rest), gate.reshape(arch.heads, d, *rest)], dim=1)
    return (q_proj.reshape(2 * arch.heads * d, *rest), k.reshape(g * d, *rest).clone(),
            v.reshape(g * d, *rest).clone())


# -- gated DeltaNet ----------------------------------------------------------------------------------
def delta_to_mcore(hf: dict[str, torch.Tensor], arch: Arch, prefix: str) -> dict[str, torch.Tensor]:
    """``self_attention.*`` Megatron tensors of the DeltaNet whose HF weights sit under ``prefix``."""
    qk, v, nk, r = _sizes(arch)
    if arch.linear_grouped:
        w = hf[prefix + "in_proj_qkvz.weight"]
        H = w.shape[-1]
        dk, dv = arch.linear_key_dim, arch.linear_value_dim
        q, k, val, z = (x.reshape(-1, H) for x in w.reshape(nk, -1, H).split([dk, dk, r * dv, r * dv], dim=1))
        b, a = (x.reshape(-1, H) for x in hf[prefix + "in_proj_ba.weight"].reshape(nk, 2 * r, H).split([r, r], dim=1))
        proj = [q, k, val, z, b, a]
    else:
        proj = [hf[prefix + "in_proj_qkv.weight"], *(hf[prefix + f"in_proj_{x}.weight"] for x in "zba")]
    out = {"self_attention.in_proj.weight": torch.cat(proj)}
    out.update({f"self_attention.{m}": hf[prefix + h] for m, h in DELTA.items()})
    return out


def delta_to_hf(mc: dict[str, torch.Tensor], arch: Arch, prefix: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`delta_to_mcore` (``mc`` keyed by the names under ``self_attention.``)."""
    qk, v, nk, r = _sizes(arch)
    out = {prefix + h: mc[m] for m, h in DELTA.items()}
    w = mc["in_proj.weight"]
    H = w.shape[-1]
    q, k, val, z, b, a = w.split([qk, qk, v, v, arch.linear_value_heads, arch.linear_value_heads])
    if arch.linear_grouped:
        dk, dv = arch.linear_key_dim, arch.linear_value_dim
        out[prefix + "in_proj_qkvz.weight"] = torch.cat(
            [q.reshape(nk, dk, H), k.reshape(nk, dk, H), val.reshape(nk, r * dv, H), z.reshape(nk, r * dv, H)],
            dim=1).reshape(-1, H)
        out[prefix + "in_proj_ba.weight"] = torch.cat([b.reshape(nk, r, H), a.reshape(nk, r, H)], dim=1).reshape(-1, H)
    else:
        out[prefix + "in_proj_qkv.weight"] = torch.cat([q, k, val])
        out.update({prefix + f"in_proj_{n}.weight": x.clone() for n, x in zip("zba", (z, b, a))})
    return out
