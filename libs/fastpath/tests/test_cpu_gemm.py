import pytest
import torch
import torch.nn.functional as F
from miles_fastpath import cpu_gemm

onednn = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="this torch build has no oneDNN linear")


@onednn
@pytest.mark.parametrize("bias", [True, False])
def test_trainable_linear_equals_f_linear_with_gradients(bias):
    """Forward and the gradients of input, weight and bias as F.linear's (float32 rounding apart),
    on a 3-D input, a transposed (non-contiguous) incoming gradient included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 70, 48, generator=g).requires_grad_()
    w = torch.randn(96, 48, generator=g).requires_grad_()
    b = torch.randn(96, generator=g).requires_grad_() if bias else None
    got, want = cpu_gemm.trainable_linear(x, w, b), F.linear(x, w, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dy = torch.randn(3, 96, 70, generator=g).transpose(1, 2)
    inputs = [t for t in (x, w, b) if t is not None]
    for a, c in zip(torch.autograd.grad(got, inputs, dy), torch.autograd.grad(want, inputs, dy)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-4)
    frozen = cpu_gemm.trainable_linear(x, w.detach(), None)  # no weight gradient asked for
    (dx,) = torch.autograd.grad(frozen.sum(), [x])
    torch.testing.assert_close(dx, F.linear(torch.ones(3, 70, 96), w.detach().t()), rtol=1e-5, atol=1e-4)


@onednn
def test_packed_weights_serve_any_row_count_and_the_fused_add():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(64, 32, generator=g), torch.randn(64, generator=g)
    packed = cpu_gemm.pack(w)
    for rows in (1, 7, 64, 129):
        x, other = torch.randn(rows, 32, generator=g), torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(cpu_gemm.linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cpu_gemm.linear_add(x, packed, b, other), other + F.linear(x, w, b),
                                   rtol=1e-5, atol=1e-5)


def test_resolve_by_vendor_and_layer_size(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: True)
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "AuthenticAMD")
    big, small = cpu_gemm.ONEDNN_MIN_LAYER, cpu_gemm.ONEDNN_MIN_LAYER - 1
    assert [cpu_gemm.resolve("auto", big), cpu_gemm.resolve("auto", small)] == ["onednn", "mkl"]
    assert cpu_gemm.resolve("onednn", small) == "onednn" and cpu_gemm.resolve("mkl", big) == "mkl"
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "GenuineIntel")
    assert cpu_gemm.resolve("auto", big) == "mkl"
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)
    with pytest.raises(ValueError, match="no oneDNN"):
        cpu_gemm.resolve("onednn")
    with pytest.raises(ValueError, match="not one of auto, mkl, onednn"):
        cpu_gemm.resolve("blas")


def test_layer_weights_counts_the_first_decoder_layer():
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    # q, o 32x32; k, v 16x32; gate, up, down 64x32
    assert cpu_gemm.layer_weights(transformers.Qwen2ForCausalLM(cfg)) == 2 * 1024 + 2 * 512 + 3 * 2048
    assert cpu_gemm.layer_weights(torch.nn.Linear(4, 4)) == 0
