from typing import Literal

from miles_lowp.settings import QATSettings
from pydantic import ConfigDict, Field


class MegatronConfig(QATSettings):
    model_config = ConfigDict(extra="forbid")

    world_size: int | None = Field(None, ge=1, description="trainer ranks; null = follow the launcher "
                                   "(env WORLD_SIZE, default 1). Must be a multiple of "
                                   "tensor_parallel * pipeline_parallel; the quotient is the data-"
                                   "parallel size")
    device: str = Field("cuda", pattern=r"^(cpu|cuda(:\d+)?)$",
                        description="cuda or cuda:N (with several ranks, cuda means cuda:LOCAL_RANK); "
                        "megatron-core's forward needs CUDA (cpu runs only with the test suite's "
                        "CPU stand-ins)")
    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel size: attention heads, KV "
                                 "groups, FFN width and vocabulary are split over this many ranks")
    pipeline_parallel: int = Field(1, ge=1, description="pipeline-parallel size: the decoder "
                                   "layers are split into this many stages (it must divide the layer "
                                   "count), run by megatron-core's 1F1B schedule over the micro-batches")
    virtual_pipeline_parallel: int = Field(1, ge=1, description="model chunks per pipeline rank "
                                           "(megatron-core's virtual pipeline stages): with N > 1 the "
                                           "layers are cut into pipeline_parallel * N chunks, rank r "
                                           "runs chunks r, r + pipeline_parallel, ... under the "
                                           "interleaved 1F1B schedule (a smaller pipeline bubble); "
                                           "needs pipeline_parallel >= 2")
    expert_parallel: int = Field(1, ge=1, description="expert-parallel size for MoE models: the "
                                 "experts are split over this many ranks (it must divide the expert "
                                 "count and tensor_parallel * expert_parallel the world size)")
    micro_batch_size: int | None = Field(None, gt=0, description="rows per forward/backward on each "
                                         "data-parallel rank (gradient accumulation); null = a rank's "
                                         "whole share at once")
    precision: Literal["bf16", "fp32", "fp8", "mxfp8"] = Field(
        "bf16", description="bf16: bf16 compute over fp32 master weights, gradient sums and optimizer "
        "state (on CUDA a bf16 copy of the model runs forward and backward; with pipeline stages, "
        "autocast); fp32: full precision; fp8: as bf16, with the linear layers' GEMMs (not the output "
        "head) in blockwise e4m3, forward and both backward GEMMs (1x128 activations, 128x128 weights; "
        "torch._scaled_mm on CUDA, emulated with the same rounding on CPU; experts: weights rounded); "
        "mxfp8: e4m3 in 32-element blocks with power-of-two E8M0 scales (emulated). The engines get the "
        "rounded weights (engine.weights_dtype must match)")
    compile: bool = Field(False, description="on CUDA, torch.compile each decoder layer of the "
                          "model that runs forward and backward: its norms, rotary embedding and "
                          "residual adds become fused kernels (the first steps take longer while "
                          "they compile); MoE layers and gated DeltaNet's chunked rule stay eager, "
                          "where dynamo would recompile per sequence length")
    lr: float = Field(1e-4, gt=0, description="AdamW peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm (null = off)")
    peak_tflops: float | None = Field(None, gt=0, description="the device's peak TFLOP/s for the mfu metric "
                                      "(default: a table of GPUs by name; a CPU's is estimated from its cores, "
                                      "clock and vector width)")
    warmup_steps: int = Field(0, ge=0, description="linear LR warm-up, in optimizer steps")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR decay after warm-up")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of the decayed LR, as a fraction of lr")
