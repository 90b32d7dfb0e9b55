"""FP8 rollout weights (``engine.weights_dtype: fp8``): blockwise e4m3 linear and expert weights.

The trainer keeps its master weights; when they reach the engine, each linear layer's weight is
quantized in 128x128 blocks to ``float8_e4m3fn`` with one float32 scale per block, stored as
``<name>.weight`` and ``<name>.weight_scale_inv`` (Hugging Face's FP8 naming: ``weight ≈
fp8 * weight_scale_inv`` blockwise). Mixture-of-experts blocks that keep their experts as 3-D
tensors (``experts.gate_up_proj [experts, 2 * inter, hidden]``, ``experts.down_proj [experts,
hidden, inter]``) are quantized per expert the same way, with Hugging Face's expert naming
(``experts.gate_up_proj_scale_inv [experts, out blocks, in blocks]``); the fused gate/up tensor is
blocked per half, as a checkpoint of separate gate and up weights is. Linear GEMMs
(``engine.fp8_gemm``): ``scaled_mm`` runs them as FP8 GEMMs (``torch._scaled_mm``) with the
activations quantized per token and 128-column group (1x128 e4m3, the layout of blockwise FP8
inference in DeepSeek-V3 and SGLang), one GEMM per 128-column group of the weight with rowwise
scales; ``dequantized`` runs them on the weights dequantized to the activations' dtype (weight-only
FP8). Experts are weight-only in either mode, as the trainer rounds them: their weights
dequantized per forward (on CUDA all at once, on CPU those of the experts hit), then the model's
own experts forward. Embeddings, norms, routers
and the output head stay in the engine's dtype, as in FP8 checkpoints. Weights that arrive already
quantized (an fp8 tensor and its ``*_scale_inv``) are taken as they are.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Iterable

import torch
import torch.nn.functional as F

# the numerics are miles_lowp's, which the trainers share (fp8 training computes with these blocks)
from miles_lowp.fp8 import (  # noqa: F401  (re-exported: the engine's FP8 API)
    BLOCK,
    E4M3_MAX,
    dequantize_blockwise,
    fp8_linear,
    quantize_blockwise,
    scaled_mm_supported,
)


class _Quantized(torch.nn.Module):
    """FP8 buffers ``<attr>`` and ``<attr>_scale_inv`` for each attribute in ``HALVES``; ``gemm``
    (``scaled_mm`` or ``dequantized``) says how the layer multiplies by them."""

    HALVES: dict[str, int] = {}
    gemm = "dequantized"

    def matmul(self, x: torch.Tensor, attr: str) -> torch.Tensor:
        """``x @ W.T`` for the 2-D FP8 weight ``attr``."""
        if self.gemm != "scaled_mm":
            return F.linear(x, self.dequantized(attr, x.dtype))
        q, s = getattr(self, attr), getattr(self, attr + "_scale_inv")
        halves = self.HALVES[attr]
        if halves == 1:
            return fp8_linear(x, q, s)
        n = q.shape[0] // halves  # each half has its own block rows (a fused gate/up weight)
        rows = s.shape[0] // halves
        return torch.cat([fp8_linear(x, q[h * n:(h + 1) * n], s[h * rows:(h + 1) * rows]) for h in range(halves)], -1)

    def _store(self, attr: str, w: torch.Tensor) -> None:
        q, s = quantize_blockwise(w.detach(), halves=self.HALVES[attr])
        if hasattr(self, attr) and isinstance(getattr(self, attr), torch.Tensor):
            getattr(self, attr).copy_(q)
            getattr(self, attr + "_scale_inv").copy_(s)
        else:
            self.register_buffer(attr, q)
            self.register_buffer(attr + "_scale_inv", s)

    @torch.no_grad()
    def quantize_into(self, attr: str, w: torch.Tensor) -> None:
        self._store(attr, w.to(getattr(self, attr).device))

    def dequantized(self, attr: str, dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor:
        """The weight ``attr`` (of 3-D expert weights, every expert, or those in ``index``) in ``dtype``."""
        q, s = getattr(self, attr), getattr(self, attr + "_scale_inv")
        if index is not None:
            q, s = q[index], s[index]
        return dequantize_blockwise(q, s, dtype, halves=self.HALVES[attr])


class FP8Linear(_Quantized):
    """``nn.Linear`` with a blockwise e4m3 weight (buffers ``weight``, ``weight_scale_inv``)."""

    HALVES = {"weight": 1}

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._store("weight", linear.weight)
        self.bias = linear.bias

    def set_weight(self, w: torch.Tensor) -> None:
        self.quantize_into("weight", w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1]), "weight").reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)


class FP8Experts(_Quantized):
    """A mixture-of-experts block's experts (Qwen3-MoE / Mixtral layout: fused gate/up, then
    down, no biases) with per-expert blockwise e4m3 weights; same call as the module it replaces:
    ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.

    Weight-only in either ``gemm`` mode, as the trainer's ``miles_lowp.linear.RoundedExperts``
    computes: each forward dequantizes the experts' weights to the activations' dtype (on CUDA
    every expert at once, with no host read; on CPU the experts hit, into a scratch copy) and runs
    the replaced module's own forward on them (its routing and GEMMs, whichever transformers
    experts implementation it dispatches to). That costs one layer's experts in the activations'
    dtype and, on CUDA, a pass over every expert's weights a forward: small for the models this
    engine serves, too much for hundreds of large experts a layer (a grouped FP8 GEMM kernel's
    job)."""

    HALVES = {"gate_up_proj": 2, "down_proj": 1}

    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        self.num_experts = experts.num_experts
        for attr in self.HALVES:
            self._store(attr, getattr(experts, attr))
        # a shallow copy without the full-precision weights (the forward passes the dequantized
        # ones); not a child module, so the engine's weight names stay the quantized buffers
        inner = copy.copy(experts)
        inner._parameters = {k: v for k, v in experts._parameters.items() if k not in self.HALVES}
        object.__setattr__(self, "inner", inner)

    @staticmethod
    def fits(module: torch.nn.Module) -> bool:
        """Whether ``module`` holds experts in the layout this class computes."""
        return (all(isinstance(getattr(module, a, None), torch.nn.Parameter) and getattr(module, a).dim() == 3
                    for a in FP8Experts.HALVES)
                and hasattr(module, "act_fn") and hasattr(module, "num_experts")
                and getattr(module, "gate_up_proj_bias", None) is None
                and not getattr(module, "is_transposed", False) and getattr(module, "is_concatenated", True)
                and getattr(module, "has_gate", True) and not getattr(module, "has_bias", False))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        if hidden_states.is_cuda:  # one pass over every expert: no host read of which ones are hit
            weights = {a: self.dequantized(a, dtype) for a in self.HALVES}
        else:  # a host read costs nothing here: only the experts hit, the others' rows are never read
            hit = top_k_index.unique()
            weights = {}
            for a in self.HALVES:
                part = self.dequantized(a, dtype, hit)
                weights[a] = _scratch(self.num_experts, part).index_copy_(0, hit, part)
        return torch.func.functional_call(self.inner, weights, (hidden_states, top_k_index, top_k_weights),
                                          strict=False)


_SCRATCH = threading.local()  # per thread (CPU workers run forwards side by side), freed with it


def _scratch(experts: int, part: torch.Tensor) -> torch.Tensor:
    """A zeroed ``[experts, ...]`` tensor shaped like ``part``'s rows, shared by every layer of that
    shape on this thread and inference mode (a tensor made in it cannot be written outside it)."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    key = (torch.is_inference_mode_enabled(), experts, *part.shape[1:], part.dtype, part.device)
    if key not in buffers:
        buffers[key] = part.new_zeros((experts, *part.shape[1:]))
    return buffers[key]


def convert(model: torch.nn.Module, gemm: str = "dequantized") -> dict[str, tuple[_Quantized, str]]:
    """Replace the model's linear layers (not the output head) and 3-D expert weights by FP8
    ones computing with ``gemm``, in place; returns ``{weight name: (module, attribute)}`` for the
    weights converted."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = [(n, m) for n, m in model.named_modules()
             if (type(m) is torch.nn.Linear and m is not head) or FP8Experts.fits(m)]
    layers: dict[str, tuple[_Quantized, str]] = {}
    for name, mod in found:
        parent_name, _, attr = name.rpartition(".")
        fp8 = FP8Linear(mod) if isinstance(mod, torch.nn.Linear) else FP8Experts(mod)
        fp8.gemm = gemm
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, fp8)
        layers.update({f"{name}.{a}": (fp8, a) for a in fp8.HALVES})
    return layers


class FP8Weights:
    """Incoming weights of the FP8 layers: quantized on arrival (or taken as quantized)."""

    def __init__(self, layers: dict[str, tuple[_Quantized, str]]):
        self.layers = layers
        self.scales = {name + "_scale_inv": entry for name, entry in layers.items()}

    @torch.no_grad()
    def divert(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Loads the pairs that name FP8 weights; returns the others, for the usual copy."""
        rest = []
        for name, t in pairs:
            entry, scale = self.layers.get(name), self.scales.get(name)
            if entry is not None:
                mod, attr = entry
                if tuple(t.shape) != tuple(getattr(mod, attr).shape):
                    rest.append((name, t))  # the usual copy raises its shape error
                elif t.dtype == torch.float8_e4m3fn:
                    getattr(mod, attr).copy_(t)
                else:
                    mod.quantize_into(attr, t)
            elif scale is not None and t.shape == getattr(scale[0], scale[1] + "_scale_inv").shape:
                getattr(scale[0], scale[1] + "_scale_inv").copy_(t)
            else:
                rest.append((name, t))
        return rest
