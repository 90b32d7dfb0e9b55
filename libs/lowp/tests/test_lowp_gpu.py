"""On a CUDA GPU of compute capability >= 8.9: the FP8 GEMMs of training run on
``torch._scaled_mm`` and give what the CPU emulation gives (the same rounded operands, products
summed in another order), forward and both backward GEMMs, each named when it fails; and their
speed against bf16 at a 1-3B dense layer shape (printed). On any machine: the blockwise GEMM's
scale tensors, read the way cuBLAS reads them, are the scales the emulation uses."""
import time

import pytest
import torch
from miles_lowp import fp8 as f8
from miles_lowp.fp8 import scaled_mm_supported
from miles_lowp.linear import lowp_linear


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and scaled_mm_supported(torch.device("cuda"))


needs_fp8_gpu = pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 GEMMs (compute capability >= 8.9)")

# (tokens, in features, out features): non-multiples of 128 (forward 8 K-groups, input gradient 5,
# weight gradient 3), and one whose input gradient has 8 groups of 128x128 weight blocks
SHAPES = [(300, 1000, 520), (256, 512, 1024)]


def _cublas_view(scale: torch.Tensor, rows: int, groups: int, ld: int, block_rows: bool) -> torch.Tensor:
    """``[rows or row blocks, groups]``: what cuBLAS reads from ``scale``'s memory. 1x128 scales:
    outer-dim-major with leading dimension ``ld`` (the operand's rows); 128x128: one run of
    ``ld = round_up(groups, 4)`` floats per 128-row block (cuBLAS' layout, whatever torch checks)."""
    if block_rows:
        return scale.as_strided((-(-rows // 128), groups), (ld, 1), scale.storage_offset())
    return scale.as_strided((rows, groups), (1, ld), scale.storage_offset())


def _torch_accepts(t: torch.Tensor, scale: torch.Tensor, block_rows: bool) -> bool:
    """``torch._scaled_mm``'s own check of a 1x128 / 128x128 scale for the operand ``t [R, K]``."""
    R, G = t.shape[0], -(-t.shape[1] // 128)
    want = ((-(-R // 128), G), (G, 1)) if block_rows else ((R, G), (1, R))
    return scale.dim() == 2 and all(scale.shape[d] == n and (n <= 1 or scale.stride(d) == s)
                                    for d, (n, s) in enumerate(zip(*want)))


@pytest.mark.parametrize("shape", SHAPES)
def test_blockwise_scales_are_what_cublas_reads(shape):
    T, K, N = shape
    torch.manual_seed(0)
    x, w, dy = torch.randn(T, K), torch.randn(N, K), torch.randn(T, N)
    q, s = f8.quantize_blockwise(w)
    qt, st = q.t().contiguous(), s.t()
    gemms = {  # (a, sa, b, sb, b's 128x128 block scales): the three GEMMs as linear.py builds them
        "forward y = x W^T": (*f8.quantize_groups(x), q, f8.block_row_scales(s, N), s),
        "dgrad dx = dy W": (*f8.quantize_groups(dy), qt, f8.block_row_scales(st, K), st),
        "wgrad dW = dy^T x": (*f8.quantize_groups(dy.t()), *f8.quantize_groups(x.t()), None),
    }
    for name, (aq, sa, bq, sb, blocks) in gemms.items():
        a, b, scale_a, scale_b, recipe = f8.blockwise_operands(aq, sa, bq, sb, blocks)
        G = a.shape[1] // 128
        block_rows = recipe == "1x128 x 128x128"
        assert b.stride(0) == 1, f"{name}: cuBLAS wants a column-major second operand"
        assert _torch_accepts(a, scale_a, False), f"{name}: torch rejects scale_a {scale_a.stride()}"
        assert _torch_accepts(b.t(), scale_b.t(), block_rows), f"{name}: torch rejects scale_b {scale_b.stride()}"
        ld_b = -(-G // 4) * 4 if block_rows else b.shape[1]
        try:
            read_a = _cublas_view(scale_a, a.shape[0], G, a.shape[0], False)
            read_b = _cublas_view(scale_b, b.shape[1], G, ld_b, block_rows)
        except RuntimeError as e:
            pytest.fail(f"{name} ({recipe}): cuBLAS would read past the scales: {e}")
        if block_rows:
            read_b = read_b.repeat_interleave(128, 0)[:b.shape[1]]
        got = (f8.dequantize_groups(a, read_a) @ f8.dequantize_groups(b.t(), read_b).t())[:aq.shape[0], :bq.shape[0]]
        want = f8.grouped_mm(aq, sa, bq, sb, emulate=True)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4 * float(want.abs().mean())), \
            f"{name} ({recipe}): max error {float((got - want).abs().max()):.3g}"
        assert block_rows == (blocks is not None and G % 4 == 0), f"{name}: {recipe}"


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("blockwise", [True, False])
def test_scaled_mm_training_gemms_match_the_emulation(blockwise, shape, monkeypatch):
    # blockwise: one cuBLAS GEMM with 1x128 / 128x128 scales; else the rowwise GEMM per group
    monkeypatch.setattr(f8, "_BLOCKWISE", {} if blockwise else {0: False, None: False})
    T, K, N = shape
    torch.manual_seed(0)
    x = torch.randn(T, K, device="cuda", requires_grad=True)
    w = torch.randn(N, K, device="cuda", requires_grad=True)
    dy = torch.randn(T, N, device="cuda")
    outs = {}
    for emulate in (False, True):
        x.grad = w.grad = None
        y = lowp_linear(x, w, None, "fp8", emulate=emulate)
        y.backward(dy)
        outs[emulate] = (y.detach(), x.grad.clone(), w.grad.clone())
    if blockwise:
        assert f8._BLOCKWISE.get(0, True), "this GPU's torch has no blockwise-scaled _scaled_mm"
    bad = []
    for name, got, want in zip(("forward y", "dgrad dx", "wgrad dW"), outs[False], outs[True]):
        # cuBLAS writes its products in bf16 (per group, in the loop) before any float32 sum
        scale = float(want.abs().mean())
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * scale):
            bad.append(f"{name}: max |err| {float((got - want).abs().max()):.3g}, mean |ref| {scale:.3g}")
    assert not bad, "; ".join(bad)


@pytest.mark.gpu
@needs_fp8_gpu
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


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("shape", [(300, 1000), (4096, 2048)])
def test_compiled_quantization_equals_eager(shape):
    """On CUDA the quantizers run through ``torch.compile``: bit for bit the eager kernels' fp8
    values and scales (the weights the engine serves and the trainer's GEMM operands must be the
    same blocks), activations, their transposes and 128x128 weight blocks."""
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(*shape, device="cuda")
    got = {"groups": f8.quantize_groups(x), "groups.t": f8.quantize_groups(x.t()), "blocks": f8.quantize_blockwise(w)}
    f8._EAGER.add(True)
    try:
        want = {"groups": f8.quantize_groups(x), "groups.t": f8.quantize_groups(x.t()),
                "blocks": f8.quantize_blockwise(w)}
    finally:
        f8._EAGER.clear()
    bad = [name for name in got if not (torch.equal(got[name][0].view(torch.uint8), want[name][0].view(torch.uint8))
                                        and torch.equal(got[name][1], want[name][1]))]
    assert not bad, f"compiled quantization differs from eager: {bad}"
