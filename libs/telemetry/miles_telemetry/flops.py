"""Model FLOPs utilisation: a causal LM's training FLOPs from its config, the device's peak from a
table (or an override), and the per-step throughput metrics both trainers report.

Training FLOPs follow the usual accounting (Kaplan et al.; PaLM appendix B): 6 FLOPs per active
matmul parameter per token (forward 2, backward 4) plus the attention scores and their weighted
sum, which grow with the context; causal attention sees half the square on average.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

# dense tensor-core peaks in TFLOP/s per device (no sparsity), by precision; "fp32" is TF32
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250, "fp8": 4500, "fp32": 1100},
    "H200": {"bf16": 989, "fp8": 1979, "fp32": 495},
    "H100 PCIe": {"bf16": 756, "fp8": 1513, "fp32": 378},
    "H100": {"bf16": 989, "fp8": 1979, "fp32": 495},
    "H800": {"bf16": 989, "fp8": 1979, "fp32": 495},
    "H20": {"bf16": 148, "fp8": 296, "fp32": 74},
    "A100": {"bf16": 312, "fp32": 156},
    "A800": {"bf16": 312, "fp32": 156},
    "L40S": {"bf16": 362, "fp8": 733, "fp32": 183},
    "L4": {"bf16": 121, "fp8": 242, "fp32": 60},
    "A10": {"bf16": 125, "fp32": 62},
    "RTX 4090": {"bf16": 165, "fp8": 330, "fp32": 83},
    "V100": {"bf16": 125, "fp32": 15.7},  # fp16 tensor cores (V100 has no bf16)
    "MI300X": {"bf16": 1307, "fp8": 2615, "fp32": 654},
}


def _get(cfg: Any, *names: str) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return None


@dataclass(frozen=True)
class ModelFlops:
    """Per-token training FLOPs of a causal LM: ``matmul`` (6 x active parameters) and
    ``attention`` (times the context length the token attends to)."""

    matmul: float
    attention: float
    active_params: float

    def step(self, seq_lens: Sequence[int]) -> float:
        """Training FLOPs (forward and backward) of one pass over sequences of these lengths."""
        return self.matmul * sum(seq_lens) + self.attention * sum(s * s for s in seq_lens) / 2


def model_flops(config: Any) -> ModelFlops | None:
    """From a Hugging Face-style config (object or dict; ``text_config`` is followed); None when it
    does not describe a transformer LM (e.g. a diffusion model)."""
    cfg = _get(config, "text_config") or config
    d, layers = _get(cfg, "hidden_size", "n_embd", "d_model"), _get(cfg, "num_hidden_layers", "n_layer")
    heads, vocab = _get(cfg, "num_attention_heads", "n_head"), _get(cfg, "vocab_size")
    if not all(isinstance(x, int) and x > 0 for x in (d, layers, heads, vocab)):
        return None
    kv = _get(cfg, "num_key_value_heads") or heads
    hd = _get(cfg, "head_dim") or d // heads
    attn = d * heads * hd * 2 + d * kv * hd * 2  # q, o; k, v
    ff = _get(cfg, "intermediate_size", "n_inner") or 4 * d
    dense_mlp = 3 * d * ff  # gated MLP (gate, up, down)
    experts, top_k = _get(cfg, "n_routed_experts", "num_experts", "num_local_experts"), \
        _get(cfg, "num_experts_per_tok", "moe_topk")
    if experts and top_k:
        moe_ff = _get(cfg, "moe_intermediate_size") or ff
        shared = (_get(cfg, "n_shared_experts") or 0) * 3 * d * moe_ff \
            + 3 * d * (_get(cfg, "shared_expert_intermediate_size") or 0)
        moe_mlp = top_k * 3 * d * moe_ff + shared + d * experts  # active experts, shared ones, router
        dense_layers = min(_get(cfg, "first_k_dense_replace") or 0, layers)
        mlp = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp = layers * dense_mlp
    active = layers * attn + mlp + d * vocab  # the LM head is a matmul even when tied
    # scores (QK^T) and the weighted sum of values: 2 + 2 FLOPs per head dim per attended token
    # forward, three times that with backward
    return ModelFlops(6.0 * active, 12.0 * layers * heads * hd, float(active))


def _cpu_peak_tflops(threads: int | None) -> float:
    """A CPU's fp32 peak estimate: cores x clock x FLOPs per cycle of its widest FMA units."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    found = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.M)
    flags = found.group(1).split() if found else []
    mhz = max((float(m) for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)), default=0.0)
    try:
        import psutil

        freq = psutil.cpu_freq()
        mhz = max(mhz, freq.max if freq else 0.0)
    except (ImportError, RuntimeError, OSError):
        pass
    per_cycle = 64 if "avx512f" in flags else 32 if "fma" in flags else 16 if "asimd" in flags else 8
    cores = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return cores * (mhz or 2000.0) * 1e6 * per_cycle / 1e12


def peak_tflops(device: str, precision: str = "bf16", override: float | None = None,
                threads: int | None = None) -> float | None:
    """The peak TFLOP/s of one ``device`` (``cpu`` or a CUDA device name such as ``NVIDIA H100
    80GB HBM3``) at ``precision`` (``bf16``, ``fp8``, ``fp32``...); ``override`` wins. None for an
    unknown GPU (MFU is then left out: set the override)."""
    if override:
        return float(override)
    if device == "cpu":
        return _cpu_peak_tflops(threads)
    key = {"fp8": "fp8", "mxfp8": "fp8", "fp32": "fp32", "float32": "fp32"}.get(precision, "bf16")
    for name, peaks in PEAK_TFLOPS.items():  # longest names first where they nest (H100 PCIe, H100)
        if name.lower() in device.lower():
            return peaks.get(key, peaks["bf16"])
    return None


# the per-step metrics that depend on wall-clock time (two identical steps differ in them)
TIMED = frozenset({"tokens_per_gpu_per_s", "train_tflops_per_gpu", "mfu"})


def untimed(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` without the wall-clock ones, to compare two steps that must compute the same."""
    return {k: v for k, v in metrics.items() if k not in TIMED}


class Throughput:
    """A trainer's per-step throughput: ``metrics(seq_lens, seconds)`` gives ``train_tokens``,
    ``tokens_per_gpu_per_s``, ``train_tflops_per_gpu`` and (when the peak is known) ``mfu``.
    ``world_size`` devices share the step; on a CPU the "GPU" is the process's cores."""

    def __init__(self, config: Any, world_size: int = 1, device: str = "cpu", precision: str = "bf16",
                 peak_override: float | None = None, threads: int | None = None) -> None:
        self.flops = model_flops(config)
        self.world_size = max(1, world_size)
        self.peak = peak_tflops(device, precision, peak_override, threads)

    def metrics(self, seq_lens: Sequence[int], seconds: float) -> dict[str, float]:
        tokens = float(sum(seq_lens))
        if seconds <= 0 or not tokens:
            return {}
        out = {"train_tokens": tokens, "tokens_per_gpu_per_s": tokens / seconds / self.world_size}
        if self.flops is not None:
            tflops = self.flops.step(seq_lens) / seconds / self.world_size / 1e12
            out["train_tflops_per_gpu"] = tflops
            if self.peak:
                out["mfu"] = tflops / self.peak
        return out


def for_device(config: Any, world_size: int, device: Any, precision: str,
               peak_override: float | None = None) -> Throughput:
    """A trainer's ``Throughput`` on a torch ``device``: a GPU's peak by its CUDA name, a CPU's
    estimated from the cores torch computes on."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return Throughput(config, world_size, torch.cuda.get_device_name(device), precision, peak_override)
    return Throughput(config, world_size, "cpu", precision, peak_override, torch.get_num_threads())


def seq_lens(batch: Any) -> list[int]:
    """Tokens per row of a padded training batch (its attention mask), or none for a batch of
    non-token actions."""
    mask = getattr(batch, "attention_mask", None)
    if mask is None:
        return []
    mask = mask != 0
    while mask.dim() > 2:  # a packed batch's [B, S, S] block mask: a token is a row that attends
        mask = mask.any(-1)
    return [int(x) for x in mask.sum(-1).tolist()]
