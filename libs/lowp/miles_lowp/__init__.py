"""miles-lowp: the low-precision numerics the trainers and the torch engine share (a library, not
a plugin), so the weights the engine serves are the ones the trainer computed with.

Modules: ``fp8`` (blockwise e4m3, the grouped FP8 GEMM), ``mx`` (MXFP8: 32-element blocks, E8M0
scales), ``int4`` (symmetric INT4 per 128, packing, fake quantization), ``linear`` (the trainer's
layers in a format, and the packed weights it sends), ``pairs`` (supported training/rollout
precision pairs; torch-free). Importing the package imports none of them.
"""
