"""``trainer.compile``: torch.compile over each megatron-core ``TransformerLayer`` of a model."""
from __future__ import annotations

import torch


def compile_layers(model: torch.nn.Module, **options: object) -> None:
    """Compiles every ``TransformerLayer`` with dynamic shapes (rows and lengths change every step),
    keeping megatron-core's ``MoELayer`` eager. Its token dispatcher graph-breaks (masked_select,
    ``.item()``, warnings) and keeps the token count as an integer attribute that dynamo specializes,
    so each new sequence length would recompile the MoE frames until dynamo's recompile limit."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for m in model.modules():
        if isinstance(m, MoELayer):
            m.forward = torch.compiler.disable(m.forward)
        elif isinstance(m, TransformerLayer):
            m.compile(dynamic=True, **options)
