"""Which training precision may feed which rollout weights (torch-free: used by config checks).

Miles' rule: BF16 training serves BF16, FP8 or MXFP8 rollout weights (the engine quantizes what it
receives, and an importance-sampling correction absorbs the difference); otherwise the trainer
computes in the format the engine serves: FP8 with FP8, MXFP8 with MXFP8, and INT4 rollout only
after INT4 quantization-aware training (``trainer.qat: int4``), whose forward already sees INT4
weights. Everything else is refused before a run starts.
"""
from __future__ import annotations

PRECISIONS = ("bf16", "fp8", "mxfp8")
ROLLOUT_FORMATS = ("bf16", "fp8", "int4", "mxfp8")
SUPPORTED = (("bf16", "bf16"), ("bf16", "fp8"), ("bf16", "mxfp8"), ("fp8", "fp8"), ("mxfp8", "mxfp8"),
             ("int4", "int4"))


def training_format(precision: str, qat: str | None) -> str:
    """``int4`` under INT4 QAT, else the GEMM precision (``fp32`` counts as ``bf16``: full
    precision on the trainer's side)."""
    if qat is not None:
        return qat
    return "bf16" if precision in ("fp32", "bf16") else precision


def rollout_format(weights_dtype: str) -> str:
    """The engine's ``weights_dtype`` as a format (``model``: the engine's own float dtype)."""
    return "bf16" if weights_dtype == "model" else weights_dtype


def pair_problem(precision: str, qat: str | None, weights_dtype: str) -> str | None:
    """Why ``trainer.precision`` / ``trainer.qat`` cannot feed ``engine.weights_dtype`` (None: they
    can). The message names both keys and what would work."""
    if qat is not None and precision not in ("bf16", "fp32"):
        return (f"trainer.qat: {qat} with trainer.precision: {precision}: INT4 QAT trains over "
                f"bf16 GEMMs; use trainer.precision: bf16 with trainer.qat, or drop trainer.qat")
    train, roll = training_format(precision, qat), rollout_format(weights_dtype)
    if (train, roll) in SUPPORTED:
        return None
    where = f"trainer.precision: {precision}" + (f" and trainer.qat: {qat}" if qat else "")
    if roll == "int4":
        fix = "INT4 rollout needs trainer.qat: int4 (its forward sees the INT4 weights the engine serves)"
    elif train == "int4":
        fix = "trainer.qat: int4 trains for INT4 rollout: set engine.weights_dtype: int4"
    else:
        fix = (f"the trainer must compute in the format the engine serves (set engine.weights_dtype: {train}), "
               f"or train in bf16")
    return (f"engine.weights_dtype: {weights_dtype} with {where} is not a supported pair: {fix}. "
            f"Supported (training/rollout): bf16/bf16, bf16/fp8, bf16/mxfp8, fp8/fp8, mxfp8/mxfp8, "
            f"int4 QAT/int4")
