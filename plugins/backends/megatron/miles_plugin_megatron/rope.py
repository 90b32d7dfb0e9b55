"""Rotary embeddings of a Hugging Face config as megatron-core builds them: plain RoPE, or YaRN
(megatron-core's ``YarnRotaryEmbedding``: the same frequencies, ramp and cos/sin scale as
transformers' ``_compute_yarn_parameters``)."""
from __future__ import annotations

from typing import Any

from miles import MilesError


def rope_fields(hf: Any, rope: dict[str, Any], mla: bool = False) -> dict[str, Any]:
    """The ``Arch`` rotary fields of a config's ``rope_parameters``; other scalings are errors."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0))
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "yarn" or mla:
        raise MilesError(f"trainer megatron: model.config.rope_parameters.rope_type {kind!r} is not supported "
                         f"(plain RoPE, or YaRN without multi-latent attention)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise MilesError("trainer megatron: YaRN with model.config.rope_parameters.partial_rotary_factor != 1 "
                         "is not supported")
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor

    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or hf.max_position_embeddings / original)
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    pair = (float(mscale), float(all_dim)) if mscale and all_dim else None
    own = _yarn_get_concentration_factor(factor, *(pair or (None, None)))
    if rope.get("attention_factor") is not None and rope["attention_factor"] != own:
        raise MilesError(f"trainer megatron: model.config.rope_parameters.attention_factor="
                         f"{rope['attention_factor']} is not supported: megatron-core derives it from factor, "
                         f"mscale and mscale_all_dim ({own}); remove the key or match it")
    return {"rope_theta": theta, "yarn_factor": factor, "yarn_original_max": original,
            "yarn_beta_fast": float(rope.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(rope.get("beta_slow") or 1.0),
            "yarn_truncate": bool(rope.get("truncate", True)), "yarn_mscale": pair}


def set_yarn(config: Any, arch: Any) -> None:
    """Put ``arch``'s YaRN on a ``TransformerConfig``: GPTModel's YaRN embedding and its attention
    read these names with ``getattr`` (they are no declared config fields)."""
    mscale, all_dim = arch.yarn_mscale or (None, None)
    for key, value in dict(yarn_rotary_scaling_factor=arch.yarn_factor,
                           yarn_original_max_position_embeddings=arch.yarn_original_max,
                           yarn_beta_fast=arch.yarn_beta_fast, yarn_beta_slow=arch.yarn_beta_slow,
                           yarn_mscale=mscale, yarn_mscale_all_dim=all_dim,
                           yarn_correction_range_round_to_int=arch.yarn_truncate).items():
        setattr(config, key, value)
