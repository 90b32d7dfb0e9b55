"""The Triton W4A16 GEMM (``engine.weights_dtype: int4`` on CUDA) against the dequantized product,
and its speed at decode sizes against bf16 (printed)."""
import time

import pytest
import torch
from miles_lowp import int4 as i4

pytestmark = pytest.mark.gpu


def _triton() -> bool:
    from miles_plugin_torch_engine.w4a16 import available

    return available()


@pytest.mark.skipif(not _triton(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("M, N, K, dtype", [(1, 896, 896, torch.bfloat16), (37, 4864, 896, torch.bfloat16),
                                            (300, 130, 256, torch.float16), (5, 64, 128, torch.float32)])
def test_w4a16_equals_the_dequantized_product(M, N, K, dtype):
    from miles_plugin_torch_engine.w4a16 import supports, w4a16_linear

    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda")
    packed, scale = i4.quantize_packed(w)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    assert supports(x, packed)
    got = w4a16_linear(x, packed, scale)
    want = torch.nn.functional.linear(x, i4.dequantize_packed(packed, scale, dtype=dtype))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().mean())), \
        float((got.float() - want.float()).abs().max())


@pytest.mark.skipif(not _triton(), reason="needs CUDA and Triton")
def test_w4a16_decode_speed():
    from miles_plugin_torch_engine.w4a16 import w4a16_linear

    N, K = 8192, 2048
    w = torch.randn(N, K, device="cuda")
    packed, scale = i4.quantize_packed(w)
    wb = w.to(torch.bfloat16)
    for M in (1, 16, 256):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        times = {}
        for name, fn in (("bf16", lambda x=x: torch.nn.functional.linear(x, wb)),
                         ("w4a16", lambda x=x: w4a16_linear(x, packed, scale)),
                         ("dequantize", lambda x=x: torch.nn.functional.linear(
                             x, i4.dequantize_packed(packed, scale, dtype=x.dtype)))):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - t0) / 20
        print(f"\nMEASURED {torch.cuda.get_device_name()} {M}x{K} @ ({N}x{K})^T: "
              + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in times.items()))
        assert times["w4a16"] > 0
