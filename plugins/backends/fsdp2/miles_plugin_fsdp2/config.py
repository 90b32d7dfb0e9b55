from typing import Literal

from miles_lowp.settings import QATSettings
from pydantic import ConfigDict, Field, field_validator

DEVICE = r"^(cpu|auto|cuda(:\d+)?)$"


class FSDP2Config(QATSettings):
    model_config = ConfigDict(extra="forbid")

    world_size: int | None = Field(None, ge=1, description="trainer ranks; null = follow the launcher "
                                   "(env WORLD_SIZE, default 1). A value that disagrees with the "
                                   "launcher is an error")
    device: str = Field("cpu", pattern=DEVICE, description="cpu, cuda, cuda:N or auto (with several ranks, cuda and "
                                           "auto mean cuda:LOCAL_RANK)")
    shard: bool | None = Field(None, description="FSDP2 fully_shard the model; null = only when "
                               "world_size > 1 (world size 1 stays plain torch); true also at world "
                               "size 1, e.g. for FSDP2 mixed precision on one GPU")
    mixed_precision: Literal["bf16", "fp32"] | None = Field(
        "bf16", description="when sharded on CUDA: bf16 = FSDP2 MixedPrecisionPolicy (bf16 compute, "
                            "fp32 master weights and gradient reduce); fp32 or null = full precision. "
                            "Ignored on CPU and by the unsharded world-size-1 path")
    precision: Literal["bf16", "fp8", "mxfp8"] = Field(
        "bf16", description="the GEMMs of the linear layers (not the output head): bf16 = the model's "
        "dtype (with mixed_precision on CUDA); fp8 = blockwise e4m3 in forward and both backward GEMMs "
        "(1x128 activations, 128x128 weights; torch._scaled_mm on CUDA, emulated with the same rounding on "
        "CPU); mxfp8 = e4m3 in 32-element blocks with power-of-two E8M0 scales (emulated: Hopper and "
        "CPUs have no MX tensor cores). Master weights, gradients and optimizer state stay fp32; the "
        "engines get the rounded weights (engine.weights_dtype must match)")
    lr: float = Field(1e-4, gt=0, allow_inf_nan=False, description="AdamW peak learning rate")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False, description="AdamW epsilon")
    grad_clip: float | None = Field(1.0, gt=0, allow_inf_nan=False, description="max global grad norm "
                                    "(null = off)")
    peak_tflops: float | None = Field(None, gt=0, description="the device's peak TFLOP/s for the mfu metric "
                                      "(default: a table of GPUs by name; a CPU's is estimated from its cores, "
                                      "clock and vector width)")
    micro_batch_size: int | None = Field(None, gt=0, description="rows per forward/backward on each "
                                         "rank (gradient accumulation); null = a rank's whole share "
                                         "at once")
    cpu_workers: int | None = Field(None, ge=1, description="world size 1 on CPU: threads that each "
                                    "run a slice of every batch (data parallelism over the cores of "
                                    "one process), each with run.threads / cpu_workers intra-op "
                                    "threads; null = min(run.threads, 8); 1 = off (every op on all "
                                    "threads)")
    cpu_gemm: Literal["auto", "mkl", "onednn"] = Field(
        "auto", description="on CPU, the Llama-family fast path's GEMMs by the weights (forward and "
        "input gradients): oneDNN was 1.2-1.4x faster than MKL on an AMD EPYC host, on par on an "
        "Intel Xeon (benchmarks/cpu_gemm.py), and small layers slower in oneDNN; auto: oneDNN on AMD "
        "CPUs where torch has it for decoder layers of >= 512k weights, else MKL")
    compile: bool = Field(False, description="on CUDA, torch.compile each decoder layer: its norms, "
                          "activation and rotary embedding become fused kernels (the first steps "
                          "take longer while they compile); ignored on CPU")
    warmup_steps: int = Field(0, ge=0, description="linear LR warm-up, in optimizer steps")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR decay after warm-up")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of the decayed LR, as a fraction of lr")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each AdamW beta must be in [0, 1), got {list(v)}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return cuda_available(v)


def cuda_available(device: str) -> str:
    """A ``cuda`` device only where torch sees a GPU (checked before any model is built)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"{device!r} needs a CUDA GPU, and torch sees none here; use cpu or auto")
    return device
