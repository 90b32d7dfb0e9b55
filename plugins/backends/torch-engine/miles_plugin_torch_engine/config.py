"""Config of the ``torch`` engine. Kept free of torch imports so registration stays cheap."""
from typing import Literal, Optional, Union

import pydantic
from pydantic import Field, field_validator, model_validator


class SpeculativeConfig(pydantic.BaseModel, extra="forbid"):
    """``engine.speculative``: draft ``tokens`` per step, verified by the target in one forward
    with rejection sampling (the samples keep exactly the target's distribution)."""

    draft: Literal["head", "model", "mtp"] = Field(
        description='"head": an EAGLE-style one-layer head on the target\'s hidden states (trained by the '
        'trainer with a top-level draft: section, or read from path); "model": a small model folder with the '
        'same tokenizer (model_path); "mtp": the model\'s own multi-token-prediction layers (DeepSeek-V3, GLM-4.5; '
        'on the model\'s own forward, engine.impl hf)')
    tokens: int = Field(3, ge=1, le=16, description="draft tokens proposed per step (k)")
    path: Optional[str] = Field(None, description="draft head: a draft_head.safetensors (or the folder "
                                "holding one, e.g. an exported model) to start from")
    model_path: Optional[str] = Field(None, description="draft model: its Hugging Face folder")
    max_batch: Union[int, Literal["auto"]] = Field(
        "auto", description="a generate call of more rows (prompts x n) than this decodes without "
        "speculation, where the verify forward costs more than the steps it saves; auto: 8 on CUDA "
        "with cuda_graphs (the step is replayed from CUDA graphs), off on CUDA without and on CPU "
        "(measured: a drafted step never pays there)")
    min_accept_len: Union[float, Literal["auto"], None] = Field(
        "auto", description="a call drafts only while the acceptance length of the last drafted calls "
        "(tokens a row gains per verify step, bonus included) is at least this; below it calls decode "
        "plain and every 8th drafts again to measure (an online-trained draft improves); auto: 2.0 on "
        "CUDA with max_batch auto (a drafted step at <= 8 rows costs 1.75-2.5 plain ones), else none; "
        "null: always draft")

    @model_validator(mode="after")
    def _complete(self):
        if self.draft == "model" and not self.model_path:
            raise ValueError("draft model needs engine.speculative.model_path (a model folder with the same "
                             "tokenizer)")
        if self.draft == "mtp" and (self.path or self.model_path):
            raise ValueError("draft mtp drafts with the model's own MTP layers; remove engine.speculative.path and "
                             "model_path")
        if isinstance(self.max_batch, int) and self.max_batch < 1:
            raise ValueError("max_batch must be >= 1 or auto")
        if isinstance(self.min_accept_len, float) and self.min_accept_len < 1:
            raise ValueError("min_accept_len must be >= 1 (a verify step gains at least one token), auto or null")
        return self


class TorchEngineConfig(pydantic.BaseModel, extra="forbid"):
    device: str = Field("cpu", pattern=r"^(cpu|auto|cuda(:\d+)?)$",
                        description='"cpu", "cuda", "cuda:N", or "auto" (cuda when available)')
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the engine's model weights and KV cache")
    weights_dtype: Literal["model", "fp8", "int4", "mxfp8"] = Field(
        "model", description='"fp8": linear layers (not the output head) and 3-D MoE expert weights '
        '(per expert) hold blockwise 128x128 float8_e4m3fn weights with a weight_scale_inv per block, '
        'quantized from the trainer\'s weights at every sync (pair with algorithm.tis_cap, or train with '
        'trainer.precision: fp8); "int4": the same weights packed as symmetric INT4 with a scale per 128 '
        '(W4A16; needs trainer.qat: int4); "mxfp8": e4m3 with an E8M0 scale per 32 weights, a linear '
        'layer\'s activations rounded alike (emulated); expert weights compute weight-only, as the trainer '
        'rounds them; each runs the model\'s own forward; "model": the engine.dtype weights')
    quant_scope: Literal["all", "experts"] = Field(
        "all", description='with weights_dtype int4: which weights are INT4: "all" linear layers but the '
        'output head and the MoE expert weights, or only the "experts" (must match trainer.qat_scope)')
    fp8_gemm: Literal["auto", "scaled_mm", "dequantized"] = Field(
        "auto", description='with weights_dtype fp8: "scaled_mm" runs FP8 GEMMs (torch._scaled_mm; '
        'activations quantized per token and 128-column group), "dequantized" multiplies by the weights '
        'dequantized to engine.dtype (weight-only FP8); auto: scaled_mm on CPU and on CUDA GPUs of '
        'compute capability >= 8.9, else dequantized')
    max_batch_size: int = Field(
        1024, ge=1, description="max sequences decoded in one forward; larger requests are chunked")
    impl: Literal["auto", "fast", "hf"] = Field(
        "auto", description='"fast": the built-in Llama-family forward (Llama, Qwen2, Qwen3, Mistral '
        'without sliding window) over a KV cache allocated once, with continuous batching and CUDA '
        'graphs; "hf": the model\'s own forward (any causal LM), under the same scheduler (per-row cache '
        'slots, continuous batching, CUDA graphs) when transformers holds its every cache layer statically '
        '(or the architecture holds them: DeepSeek-V4), on CUDA and on CPU in float32; "auto": fast on '
        'CUDA, and on CPU in float32, when the architecture is supported, else hf')
    max_seq_len: Optional[int] = Field(
        None, ge=2, description="fast path: KV-cache positions per sequence (prompt + new tokens); "
        "unset: sized from the first request and grown when a longer one comes")
    cuda_graphs: bool = Field(
        True, description="replay the decode step from CUDA graphs, one per batch/length bucket, on the "
        "fast path and on the model's own forward (impl: hf) in cache slots; the per-call path (speculative "
        "configs) captures one per generate chunk over a static cache")
    cpu_workers: Optional[int] = Field(
        None, ge=1, description="fast path on CPU: decode steps split their rows among this many "
        "worker threads of one intra-op thread each (steps too small to gain from it stay on one); unset: "
        "torch's intra-op thread count")
    cpu_gemm: Literal["auto", "mkl", "onednn"] = Field(
        "auto", description="fast path on CPU: the library of the GEMMs by the weights. oneDNN (on "
        "weights packed at every generate) was 1.2-1.4x faster than MKL on an AMD EPYC host, MKL "
        "1.25x faster on an Intel Xeon (benchmarks/cpu_gemm.py), and small layers slower in oneDNN; "
        "auto: oneDNN on AMD CPUs where torch has it for decoder layers of >= 512k weights, else MKL")
    prefill_tokens: int = Field(
        16384, ge=1, description="fast path: max (padded) prompt tokens prefilled in one forward")
    speculative: Optional[SpeculativeConfig] = Field(
        None, description="speculative decoding: {draft: head | model | mtp, tokens: k, path, model_path, "
        "max_batch}; head and model on the fast path, mtp on the model's own forward")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v.startswith("cuda"):  # checked before any model is built; torch only imported here
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"{v!r} needs a CUDA GPU, and torch sees none here; use cpu or auto")
        return v

    @model_validator(mode="after")
    def _fp8_runs_the_models_forward(self):
        if self.weights_dtype != "model" and self.impl == "fast":
            raise ValueError(f"engine.weights_dtype={self.weights_dtype} runs the model's own forward (its "
                             f"quantized linear layers); set engine.impl=auto or hf")
        return self
