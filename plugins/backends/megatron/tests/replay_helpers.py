"""Rollout routing replay (R3) fixtures shared by the CPU and GPU tests: the ``moe`` model spec
(through the plugin registry, as a run makes it), samples carrying recorded experts, and hooks
that capture which experts each router used."""
from __future__ import annotations

import functools
from typing import Any

import torch
from helpers import BASE, FAMILIES

MOE = {**BASE, **FAMILIES["qwen3_moe"]}  # 2 layers, 4 experts, top-2


class Tok:
    """The few tokenizer attributes the hf spec reads for an inline config."""

    pad_token_id, eos_token_id, bos_token_id = 0, None, None

    def __len__(self) -> int:
        return BASE["vocab_size"]


def r3_spec(replay: bool = True, **over: Any) -> Any:
    """The ``moe`` model spec over an inline Qwen3-MoE config, from the run's plugin registry."""
    from miles import make_plugin_manager

    pm = make_plugin_manager()
    comp = pm.registry("model_specs")["moe"]
    settings = comp.config.model_validate({"base": {"name": "hf", "config": {**MOE, **over}},
                                           "routing_replay": replay})
    return pm.create("model_specs", "moe", settings, pm=pm)


def record(b: Any, seed: int = 7, skip: tuple[int, ...] = (1,)) -> None:
    """Random distinct expert ids ``[prompt + response - 1, layers, top_k]`` (int32) on every
    sample of ``b`` but those in ``skip`` (left without a record: routed as usual)."""
    g = torch.Generator().manual_seed(seed)
    layers, k, experts = MOE["num_hidden_layers"], MOE["num_experts_per_tok"], MOE["num_experts"]
    for i, s in enumerate(b.samples):
        if i in skip:
            s.extensions.pop("moe", None)
            continue
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        ids = torch.rand(n, layers, experts, generator=g).argsort(-1)[..., :k]
        s.extensions["moe"] = {"routed_experts": ids.to(torch.int32)}


class MegatronRouting:
    """Per layer (0-based), the expert sets each megatron-core router chose in the last forward:
    ``{layer: [B, S, experts] bool}`` on the right-aligned rows."""

    def __init__(self, model: torch.nn.Module, rows: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.rows, self.maps = rows, {}
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, TopKRouter)]

    def _hook(self, module: Any, args: Any, out: Any) -> None:
        routing_map = out[1].detach().cpu()  # [S * B, experts], sequence-major
        S = routing_map.shape[0] // self.rows
        self.maps[module.layer_number - 1] = routing_map.view(S, self.rows, -1).transpose(0, 1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class HFRouting:
    """The same for the Hugging Face model of the ``moe`` spec (the routers its replay hooks
    return ``(logits, weights, index)``), on the batch's left-padded rows. Registered after the
    replay hook, this one sees the replayed experts."""

    def __init__(self, model: torch.nn.Module, rows: int, experts: int):
        from miles_plugin_moe.router import RouterHook

        self.rows, self.experts, self.maps, self.handles = rows, experts, {}, []
        for m in model.modules():
            layers = [h.layer for h in m._forward_hooks.values() if isinstance(h, RouterHook)]
            if layers:
                self.handles.append(m.register_forward_hook(functools.partial(self._hook, layers[0])))

    def _hook(self, layer: int, module: Any, args: Any, out: Any) -> None:
        index = out[2].detach().cpu()  # [B * W, k], row-major
        self.maps[layer] = as_sets(index, self.experts).view(self.rows, -1, self.experts)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def as_sets(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """``[..., k]`` expert ids -> ``[..., experts]`` bool."""
    hit = torch.zeros(*ids.shape[:-1], experts, dtype=torch.bool)
    return hit.scatter_(-1, ids.long(), True)
