"""On a CUDA GPU of compute capability >= 8.9: the FP8 GEMMs of training run on
``torch._scaled_mm`` and give what the CPU emulation gives (the same rounded operands, products
summed in another order), forward and both backward GEMMs; and their speed against bf16 at a 1-3B
dense layer shape (printed)."""
import time

import pytest
import torch
from miles_lowp.fp8 import scaled_mm_supported
from miles_lowp.linear import lowp_linear

pytestmark = pytest.mark.gpu


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and scaled_mm_supported(torch.device("cuda"))


@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 GEMMs (compute capability >= 8.9)")
@pytest.mark.parametrize("blockwise", [True, False])
def test_scaled_mm_training_gemms_match_the_emulation(blockwise, monkeypatch):
    from miles_lowp import fp8

    # blockwise: one cuBLAS GEMM with 1x128 / 128x128 scales; else the rowwise GEMM per group
    monkeypatch.setattr(fp8, "_BLOCKWISE", {} if blockwise else {0: False, None: False})
    torch.manual_seed(0)
    x = torch.randn(300, 1000, device="cuda", requires_grad=True)
    w = torch.randn(520, 1000, device="cuda", requires_grad=True)
    dy = torch.randn(300, 520, device="cuda")
    outs = {}
    for emulate in (False, True):
        x.grad = w.grad = None
        y = lowp_linear(x, w, None, "fp8", emulate=emulate)
        y.backward(dy)
        outs[emulate] = (y.detach(), x.grad.clone(), w.grad.clone())
    if blockwise:
        assert fp8._BLOCKWISE.get(0, True), "this GPU's torch has no blockwise-scaled _scaled_mm"
    for got, want in zip(outs[False], outs[True]):
        # cuBLAS writes its products in bf16 (per group, in the loop) before any float32 sum
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().mean())), \
            float((got - want).abs().max())


@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 GEMMs (compute capability >= 8.9)")
def test_fp8_linear_speed_against_bf16():
    T, H, F = 8192, 2048, 8192  # a 1.5B-class decoder's MLP up projection, 8k tokens
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(F, H, device="cuda", requires_grad=True)  # fp32 master weight
    dy = torch.randn(T, F, device="cuda", dtype=torch.bfloat16)

    def step(fp8: bool) -> None:
        y = lowp_linear(x, w, None, "fp8") if fp8 else torch.nn.functional.linear(x, w.to(torch.bfloat16))
        y.backward(dy)

    times = {}
    for fp8 in (False, True):
        for _ in range(2):
            step(fp8)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step(fp8)
        torch.cuda.synchronize()
        times[fp8] = (time.perf_counter() - t0) / 5
    print(f"\nMEASURED {torch.cuda.get_device_name()} linear {T}x{H}->{F} forward+backward: bf16 "
          f"{times[False] * 1e3:.2f} ms ({T / times[False]:.0f} tokens/s), fp8 blockwise "
          f"{times[True] * 1e3:.2f} ms ({T / times[True]:.0f} tokens/s), "
          f"fp8/bf16 time {times[True] / times[False]:.2f}x")
    assert times[True] > 0
