"""token_logprobs: the plain formula on CPU (against log_softmax), and on CUDA the fused Triton
kernels against the plain formula, values and gradients."""
import pytest
import torch

from miles_rlmath.logprobs import fused_available, token_logprobs

CASES = [(2, 7, 50, 5, 50, 1.0), (3, 9, 300, 4, 290, 0.7), (2, 6, 9000, 6, 8999, 1.3)]


def _inputs(B, S, V, R, vocab, dtype, device="cpu"):
    g = torch.Generator().manual_seed(B * S + V)
    x = (torch.randn(B, S, V, generator=g) * 3).to(dtype).to(device).requires_grad_(True)
    index = torch.stack([torch.randperm(S, generator=g)[:R].sort().values for _ in range(B)]).to(device)
    targets = torch.randint(0, vocab, (B, R), generator=g).to(device)
    return x, index, targets


@pytest.mark.parametrize("B,S,V,R,vocab,T", CASES)
def test_plain_formula_is_log_softmax_of_the_selected_rows(B, S, V, R, vocab, T):
    x, index, targets = _inputs(B, S, V, R, vocab, torch.float32)
    got = token_logprobs(x, targets, T, index, vocab)
    rows = torch.stack([x[b, index[b]] for b in range(B)])[..., :vocab] / T
    want = torch.log_softmax(rows, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32 and got.shape == (B, R)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    got.sum().backward()
    if vocab < V:
        assert x.grad[..., vocab:].abs().max() == 0  # padding columns get nothing
    assert not fused_available("cpu")


def test_without_index_every_position_is_a_response_token():
    x, _, targets = _inputs(2, 5, 40, 5, 40, torch.float32)
    want = torch.log_softmax(x.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(x, targets), want, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,V,R,vocab,T", CASES + [(4, 33, 151936, 30, 151936, 1.0)])
def test_fused_kernels_match_the_plain_formula_on_cuda(B, S, V, R, vocab, T, dtype):
    assert fused_available("cuda")
    x, index, targets = _inputs(B, S, V, R, vocab, dtype, "cuda")
    grad = torch.randn(B, R, device="cuda")
    got = token_logprobs(x, targets, T, index, vocab)  # the fused path: CUDA with Triton
    (got * grad).sum().backward()
    plain = x.detach().cpu().float().requires_grad_(True)  # the same values, the plain formula on CPU
    want = token_logprobs(plain, targets.cpu(), T, index.cpu(), vocab)
    (want * grad.cpu()).sum().backward()
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=0, atol=2e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 gradients: one rounding of values up to ~3
    torch.testing.assert_close(x.grad.float().cpu(), plain.grad, rtol=0, atol=tol)
    assert got.grad_fn is not None and "Fused" in type(got.grad_fn).__name__
