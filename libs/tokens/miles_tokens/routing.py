"""Recorded MoE routing (rollout routing replay, R3) laid out like a batch's tokens."""
from __future__ import annotations

from typing import Any, Sequence


def routed_experts_rows(samples: Sequence[Any], extension: str, layers: int, top_k: int, width: int,
                        starts: Sequence[int] | None = None, experts: int | None = None) -> Any:
    """``[B, width, layers, top_k]`` long expert ids: sample ``i``'s record
    ``extensions[extension]["routed_experts"]`` (``[tokens, layers, top_k]``, or flat as SGLang
    sends it) from row position ``starts[i]`` (default 0) on, -1 where nothing was recorded
    (no record, padding, the last response token). A record that does not fit ``layers``,
    ``top_k`` and ``width``, or names an expert id ``>= experts``, is a ValueError naming the
    sample, so the trainer never replays another model's routing."""
    import torch

    table = torch.full((len(samples), width, layers, top_k), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        rec = ((getattr(s, "extensions", None) or {}).get(extension) or {}).get("routed_experts")
        if rec is None:
            continue
        rec = torch.as_tensor(rec)
        if rec.dim() == 1 and layers * top_k and rec.numel() % (layers * top_k) == 0:
            rec = rec.view(-1, layers, top_k)
        start = starts[row] if starts is not None else 0
        if rec.dim() != 3 or tuple(rec.shape[1:]) != (layers, top_k) or start + rec.shape[0] > width:
            raise ValueError(f"sample {row}'s routed experts have shape {tuple(rec.shape)}; this model "
                             f"and batch need [tokens <= {width - start}, {layers}, {top_k}]")
        if experts is not None and rec.numel() and int(rec.max()) >= experts:
            raise ValueError(f"sample {row} names expert {int(rec.max())}; the model has {experts} experts")
        table[row, start:start + rec.shape[0]] = rec.long()
    return table


# -- gate weights of the chosen experts, per router kind --------------------------------------------
# Each repeats its architecture's own operations in order, so that for the experts a router chose
# itself the weights are bit for bit the ones its forward returned; routing replay (R3) calls them
# with the recorded experts and the trainer's own logits, so the gradient still reaches the router.

def softmax_topk_weights(logits: Any, indices: Any, normalize: bool, cast: bool = True) -> Any:
    """Softmax over all experts, then the chosen ones' probabilities (renormalised when
    ``normalize``), cast back to the logits' dtype when ``cast`` (Qwen3-MoE, Qwen3-Next,
    Qwen3.5-MoE, Mixtral)."""
    import torch

    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype) if cast else weights


def topk_softmax_weights(logits: Any, indices: Any) -> Any:
    """Softmax over the chosen experts' logits only (gpt-oss)."""
    import torch

    chosen = logits.gather(-1, indices)
    return torch.nn.functional.softmax(chosen, dim=1, dtype=chosen.dtype)


def score_weights(scores: Any, indices: Any, normalize: bool, scale: float) -> Any:
    """Per-expert scores (a sigmoid or sqrt-softplus of the logits, without the selection bias),
    the chosen ones renormalised when ``normalize`` (with DeepSeek's 1e-20 floor), times the
    routed scaling factor (DeepSeek-V3/V4, Kimi-K2, GLM-4.5, GLM-5)."""
    weights = scores.gather(1, indices)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale


def sigmoid_moe_megatron(hf: Any) -> dict[str, Any]:
    """The megatron trainer's ``Arch`` fields for DeepSeek-V3-style MoE (GLM-4.5 routes alike),
    from its Hugging Face config: sigmoid scores plus a selection-only expert bias, groups ranked by
    their two best experts, the chosen scores renormalised and scaled, shared experts, the first
    ``first_k_dense_replace`` layers dense. A ValueError names a setting megatron-core computes
    otherwise."""
    groups, top_groups, top_k = hf.n_group or 1, hf.topk_group or 1, hf.num_experts_per_tok
    if not hf.norm_topk_prob and top_k > 1:
        raise ValueError("model.config.norm_topk_prob: false is not supported (megatron-core renormalises "
                         "the chosen sigmoid scores)")
    return dict(experts=hf.n_routed_experts, topk=top_k, moe_ffn=hf.moe_intermediate_size, norm_topk=True,
                score="sigmoid", expert_bias=True, groups=groups if groups > 1 else 0,
                group_topk=top_groups if groups > 1 else 0, scaling=float(hf.routed_scaling_factor),
                shared_ffn=hf.moe_intermediate_size * (hf.n_shared_experts or 0),
                dense_layers=tuple(range(min(hf.first_k_dense_replace or 0, hf.num_hidden_layers))))
