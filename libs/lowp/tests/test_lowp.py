"""miles_lowp against references written here from the formats' definitions (never the code under
test): the OCP MX v1.0 scale rule and an E4M3 table built from its bit layout, hand-computed
INT4 and FP8 cases, and the supported precision pairs."""
import bisect
import math
import random

import pytest
import torch
from miles_lowp import fp8 as f8
from miles_lowp import int4 as i4
from miles_lowp import mx
from miles_lowp.linear import LowpLinear, RoundedExperts, convert, lowp_linear, packed_weights
from miles_lowp.pairs import pair_problem


def e4m3_values():
    """Every non-negative finite E4M3 value with its mantissa bits: exponent bias 7, subnormals at
    exponent field 0, S.1111.111 is NaN (so the largest is 1.75 * 2^8 = 448)."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            vals.append(((m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), m))
    return sorted(vals)


E4M3 = e4m3_values()
E4M3_ONLY = [v for v, _ in E4M3]


def round_e4m3(v: float) -> float:
    """Round to nearest E4M3, ties to the even mantissa, saturating at ±448."""
    a = min(abs(v), 448.0)
    i = bisect.bisect_left(E4M3_ONLY, a)
    if i == len(E4M3):
        return math.copysign(448.0, v)
    lo, hi = E4M3[max(i - 1, 0)], E4M3[i]
    if a - lo[0] < hi[0] - a:
        pick = lo
    elif a - lo[0] > hi[0] - a:
        pick = hi
    else:
        pick = lo if lo[1] % 2 == 0 else hi
    return math.copysign(pick[0], v)


def mx_reference(block: list[float]) -> tuple[int, list[float]]:
    """OCP MX v1.0, section 6.3: X = floor(log2(amax)) - emax_elem (8 for E4M3), then each
    element v / 2^X rounded to E4M3 (saturating). Returns (X, the dequantized block)."""
    amax = max(abs(v) for v in block)
    x = -127 if amax == 0 else max(-127, min(127, math.floor(math.log2(amax)) - 8))
    return x, [round_e4m3(v / 2.0 ** x) * 2.0 ** x for v in block]


def test_mx_against_the_spec_reference():
    rng = random.Random(0)
    blocks = [[rng.gauss(0, 1) * 10 ** rng.uniform(-6, 6) for _ in range(32)] for _ in range(40)]
    blocks += [[0.0] * 32,  # all zero: the smallest scale, zeros out
               [448.0 * 256] + [1.0] * 31,  # amax a power-of-two times 448: no saturation needed
               [479.0 * 4] + [-0.001] * 31,  # 479/256*... rounds past 448 after scaling: saturates
               [2.0 ** -130] * 32]  # below E8M0's range: clamped scale
    x = torch.tensor(blocks, dtype=torch.float32)
    q, biased = mx.quantize_mx(x)
    got = mx.dequantize_mx(q, biased)
    for row, block in enumerate(blocks):
        exp, ref = mx_reference(block)
        assert int(biased[row, 0]) - 127 == exp, row
        assert got[row].tolist() == pytest.approx(ref, rel=0, abs=0), row


def test_mx_blocks_run_along_the_last_dimension():
    x = torch.ones(2, 64)
    x[0, 40] = 1000.0  # only the second block of row 0 scales up
    _, biased = mx.quantize_mx(x)
    # floor(log2(1)) - 8 = -8 -> byte 119; floor(log2(1000)) - 8 = 9 - 8 = 1 -> byte 128
    assert biased.tolist() == [[119, 128], [119, 119]]


def test_int4_hand_computed():
    w = torch.tensor([[0.7, -0.35, 0.1, 0.0, -0.7, 0.05, 0.3, 0.2]])
    q, s = i4.quantize_int4(w, group=4)
    # group 1: amax 0.7 -> scale 0.1: 7, -3.5 -> -4 (tie to even), 1, 0
    # group 2: amax 0.7 -> scale 0.1: -7, 0.5 -> 0 (tie to even), 3, 2
    assert q.tolist() == [[7, -4, 1, 0, -7, 0, 3, 2]]
    assert s.tolist()[0] == pytest.approx([0.1, 0.1])
    p = i4.pack_int4(q)
    # (7+8) | (-4+8) << 4 = 15 | 64 = 79; 9 | 8 << 4 = 137; 1 | 8 << 4 = 129; 11 | 10 << 4 = 171
    assert p.tolist() == [[79, 137, 129, 171]]
    assert i4.unpack_int4(p).tolist() == q.tolist()
    assert i4.dequantize_packed(p, s, group=4).tolist()[0] == pytest.approx([0.7, -0.4, 0.1, 0, -0.7, 0, 0.3, 0.2])


def test_int4_fake_quant_is_straight_through():
    w = torch.randn(4, 256, requires_grad=True)
    y = i4.fake_int4(w)
    assert torch.equal(y.detach(), i4.qdq_int4(w.detach()))
    assert len(torch.unique(torch.round(y.detach()[0, :128] / i4.quantize_int4(w.detach())[1][0, 0]))) <= 16
    (y * torch.arange(256.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(256.0).expand(4, 256))  # the identity backward


def test_fp8_blocks_and_groups_hand_computed():
    w = torch.zeros(130, 130)
    w[0, 0], w[129, 129] = 4.48, -0.5
    q, s = f8.quantize_blockwise(w)
    # four blocks: amax 4.48 -> scale 0.01; two empty ones keep 1e-12 / 448; amax 0.5 -> 0.5/448
    assert s.flatten().tolist() == pytest.approx([0.01, 1e-12 / 448, 1e-12 / 448, 0.5 / 448])
    assert (float(q[0, 0]), float(q[129, 129])) == (448.0, -448.0)
    xq, sx = f8.quantize_groups(torch.tensor([[1.0, -2.0, 0.1]]), block=2)
    # groups [1, -2] (scale 2/448) and [0.1] (scale 0.1/448): 1 -> 224, -2 -> -448, 0.1 -> 448
    assert xq.float().tolist() == [[224.0, -448.0, 448.0]]
    assert sx.tolist()[0] == pytest.approx([2 / 448, 0.1 / 448])


def test_grouped_mm_emulation_matches_scaled_mm():
    if not f8.scaled_mm_supported(torch.device("cpu")):
        pytest.skip("this torch's CPU _scaled_mm takes no rowwise scales")  # torch < 2.13
    torch.manual_seed(0)
    x, w = torch.randn(37, 300), torch.randn(70, 300)
    q, s = f8.quantize_blockwise(w)
    exact = f8.fp8_linear(x, q, s, emulate=False)
    emulated = f8.fp8_linear(x, q, s, emulate=True)
    assert torch.allclose(exact, emulated, atol=1e-4, rtol=1e-5)
    rel = (emulated - x @ w.t()).norm() / (x @ w.t()).norm()
    assert 1e-4 < float(rel) < 0.1  # rounded, but close


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_lowp_linear_gradients_use_quantized_operands(fmt):
    torch.manual_seed(1)
    x = torch.randn(5, 256, requires_grad=True)
    w = torch.randn(130, 256, requires_grad=True)
    dy = torch.randn(5, 130)
    lowp_linear(x, w, None, fmt).backward(dy)

    def q_rows(t):  # groups along the last dimension, as the recipe quantizes activations
        if fmt == "fp8":
            return f8.dequantize_groups(*f8.quantize_groups(t))
        return mx.qdq_mx(t)

    def q_w(t, transposed=False):
        if fmt == "fp8":
            full = f8.dequantize_blockwise(*f8.quantize_blockwise(t))
            return full.t() if transposed else full
        return q_rows(t.t() if transposed else t)

    y = lowp_linear(x.detach(), w.detach(), None, fmt)
    assert torch.allclose(y, q_rows(x.detach()) @ q_w(w.detach()).t(), atol=1e-5)
    assert torch.allclose(x.grad, q_rows(dy) @ q_w(w.detach(), transposed=True).t(), atol=1e-5)
    assert torch.allclose(w.grad, q_rows(dy.t()) @ q_rows(x.detach().t()).t(), atol=1e-4)
    assert not torch.allclose(w.grad, dy.t() @ x.detach(), atol=1e-3)  # really rounded


class Experts(torch.nn.Module):
    """The 3-D expert layout (fused gate/up, then down) with a minimal forward."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 128))
        self.down_proj = torch.nn.Parameter(torch.randn(2, 128, 4))

    def forward(self, h):
        gate, up = (h @ self.gate_up_proj[0].t()).chunk(2, -1)
        return (torch.nn.functional.silu(gate) * up) @ self.down_proj[0].t()


def test_convert_keeps_names_and_parameters():
    torch.manual_seed(2)
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(128, 8), "mlp": torch.nn.ModuleDict({"experts": Experts()})})
    names = {n: p for n, p in model.named_parameters()}
    done = convert(model, qat="int4")
    assert done == {"proj.weight": "int4", "mlp.experts.gate_up_proj": "int4", "mlp.experts.down_proj": "int4"}
    assert isinstance(model["proj"], LowpLinear) and isinstance(model["mlp"]["experts"], RoundedExperts)
    assert {n: p for n, p in model.named_parameters()} == names  # the same objects under the same names
    h = torch.randn(3, 128)
    e = model["mlp"]["experts"]
    out = e(h)
    ref_gu = i4.qdq_int4(e.inner.gate_up_proj.detach())[0]
    gate, up = (h @ ref_gu.t()).chunk(2, -1)
    assert torch.allclose(out, (torch.nn.functional.silu(gate) * up) @ i4.qdq_int4(e.inner.down_proj.detach())[0].t(),
                          atol=1e-5)
    out.sum().backward()
    assert e.inner.gate_up_proj.grad is not None
    experts_only = torch.nn.ModuleDict({"proj": torch.nn.Linear(128, 8), "experts": Experts()})
    assert set(convert(experts_only, qat="int4", scope="experts")) == {"experts.gate_up_proj", "experts.down_proj"}


def test_packed_weights_round_trip():
    w = torch.randn(256, 256)
    out = dict(packed_weights([("a.weight", w), ("b.bias", torch.ones(3))], {"a.weight": "int4"}))
    assert set(out) == {"a.weight_packed", "a.weight_scale", "b.bias"}
    assert out["a.weight_packed"].dtype == torch.uint8 and out["a.weight_packed"].shape == (256, 128)
    assert torch.equal(i4.dequantize_packed(out["a.weight_packed"], out["a.weight_scale"]), i4.qdq_int4(w))
    out = dict(packed_weights([("a.weight", w)], {"a.weight": "mxfp8"}))
    assert out["a.weight_scale"].dtype == torch.uint8 and out["a.weight_scale"].shape == (256, 8)
    assert torch.equal(mx.dequantize_mx(out["a.weight"], out["a.weight_scale"]), mx.qdq_mx(w))


@pytest.mark.parametrize("precision, qat, rollout, ok", [
    ("bf16", None, "model", True), ("bf16", None, "fp8", True), ("bf16", None, "mxfp8", True),
    ("fp8", None, "fp8", True), ("mxfp8", None, "mxfp8", True), ("bf16", "int4", "int4", True),
    ("fp32", None, "fp8", True),
    ("bf16", None, "int4", False), ("fp8", None, "model", False), ("fp8", None, "mxfp8", False),
    ("mxfp8", None, "fp8", False), ("bf16", "int4", "model", False), ("fp8", "int4", "int4", False),
])
def test_supported_pairs(precision, qat, rollout, ok):
    problem = pair_problem(precision, qat, rollout)
    assert (problem is None) == ok, problem
    if not ok:
        assert "trainer." in problem and ("engine.weights_dtype" in problem or "trainer.qat" in problem)
