"""INT4 weights of a Hugging Face folder in the compressed-tensors format (``pack-quantized``,
the W4A16 preset: symmetric INT4, one scale per 128 weights of a row), which transformers loads
when the ``compressed-tensors`` package is installed (vLLM and SGLang read INT4 checkpoints in it).

:func:`compress_folder` rewrites the linear weights a folder holds dense: each named one becomes
``<module>.weight_packed`` (int32, eight values a word), ``<module>.weight_scale`` (float32) and
``<module>.weight_shape``, computed from the full-precision weights with this library's INT4
rounding (``miles_lowp.int4``), so the folder holds the very values the engines served; the
config gains the ``quantization_config`` that tells loaders so. Packing and the config are the
``compressed-tensors`` package's own (its ``PackedQuantizationCompressor`` and
``QuantizationConfig``).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from . import int4 as i4


class CompressedExportError(ValueError):
    """A weight this format cannot hold (the message says which and why)."""


def _scheme() -> Any:
    """compressed-tensors' W4A16 scheme, checked to be miles' INT4 (a future preset could differ)."""
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.format = CompressionFormat.pack_quantized.value
    w = scheme.weights
    if (w.num_bits, w.type, w.symmetric, w.group_size) != (4, "int", True, i4.INT4_GROUP):
        raise CompressedExportError(f"compressed-tensors' W4A16 preset is {w}, not miles' symmetric INT4 "
                                    f"in groups of {i4.INT4_GROUP}")
    return scheme


def compress_weight(w: torch.Tensor, scheme: Any = None) -> dict[str, torch.Tensor]:
    """``{weight_packed, weight_scale, weight_shape}`` of a 2-D linear weight, rounded as
    :func:`miles_lowp.int4.quantize_int4` rounds it (the scales are this library's)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    scheme = scheme or _scheme()
    if w.dim() != 2 or w.shape[-1] % i4.INT4_GROUP:
        raise CompressedExportError(f"compressed-tensors packs 2-D weights whose rows are a multiple of "
                                    f"{i4.INT4_GROUP} long, got shape {tuple(w.shape)}")
    w = w.detach().float().cpu()  # on CUDA the package quantizes with its own Triton kernel
    _, scale = i4.quantize_int4(w)
    out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    return {k: v.contiguous() for k, v in out.items()}


def compress_folder(folder: str | Path, named: Iterable[tuple[str, torch.Tensor]], formats: dict[str, str]) -> int:
    """Rewrite the ``int4`` weights of ``formats`` (``{weight name: format}``) in the Hugging Face
    folder ``folder`` as compressed-tensors ``pack-quantized`` tensors, computed from the
    full-precision weights ``named`` yields; returns how many weights were packed.

    Every name in ``formats`` must end in ``.weight``, be 2-D with rows a multiple of 128 long, be
    an ``nn.Linear`` of the folder's model and be stored in the folder under that name. Every check
    runs before any file is written, so on :class:`CompressedExportError` the folder is as it was
    (``miles export --format auto`` then keeps it dense)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    other = sorted({f for f in formats.values() if f != "int4"})
    if other:
        raise CompressedExportError(f"compressed-tensors export holds INT4 weights; these are {', '.join(other)}")
    scheme = _scheme()
    modules = {n.removesuffix(".weight") for n in formats}
    linears = _linear_modules(folder)
    odd = sorted(n for n in formats if not n.endswith(".weight") or n.removesuffix(".weight") not in linears)
    if odd:
        raise CompressedExportError(f"compressed-tensors packs nn.Linear weights only, not {', '.join(odd[:4])}"
                                    + (f" and {len(odd) - 4} more" if len(odd) > 4 else ""))
    packed = {n: {f"{n.removesuffix('weight')}{k}": v for k, v in compress_weight(w, scheme).items()}
              for n, w in named if formats.get(n) == "int4"}
    if len(packed) != len(formats):
        absent = sorted(set(formats) - set(packed))
        raise CompressedExportError(f"no full-precision weight given for {', '.join(absent[:4])}")

    where = _shards_of(folder, set(formats))
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    change = 0  # bytes: the index's total_size follows the tensors
    for shard, names in where.items():
        tensors = load_file(shard)
        for n in names:
            change -= tensors[n].numel() * tensors[n].element_size()
            del tensors[n]
            tensors.update(packed[n])
            change += sum(t.numel() * t.element_size() for t in packed[n].values())
            if index is not None:
                index["weight_map"].pop(n, None)
                index["weight_map"].update(dict.fromkeys(packed[n], shard.name))
        save_file(tensors, shard, metadata={"format": "pt"})
    if index is not None:
        meta = index.setdefault("metadata", {})
        if "total_size" in meta:
            meta["total_size"] += change
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    config = QuantizationConfig(config_groups={"group_0": scheme}, format=scheme.format,
                                quantization_status=QuantizationStatus.COMPRESSED,
                                ignore=sorted(linears - modules))
    ModelCompressor(quantization_config=config).update_config(str(folder))
    return len(formats)


def _linear_modules(folder: Path) -> set[str]:
    """The names of the ``nn.Linear`` modules of the folder's model (built on the meta device:
    no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _shards_of(folder: Path, names: set[str]) -> dict[Path, list[str]]:
    """``{safetensors file: the names it holds}`` (headers only); every name must be held."""
    from safetensors import safe_open

    where: dict[Path, list[str]] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            held = sorted(names & set(f.keys()))
        if held:
            where[shard] = held
    missing = sorted(names - {n for held in where.values() for n in held})
    if missing:
        raise CompressedExportError(f"the folder's safetensors hold no weight named {', '.join(missing[:4])}")
    return where


def dense_load_kwargs(folder: str | Path) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that load a compressed-tensors folder into plain
    ``nn.Linear`` layers, its weights dequantized in float32 and cast to the model's dtype (the
    engines' values), with no quantizer left on the model; ``{}`` for any other folder. Without
    them transformers keeps the layers packed until the first forward, which code reading
    ``.weight`` (an engine, a trainer) cannot use."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if (config.get("quantization_config") or {}).get("quant_method") != "compressed-tensors":
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}
