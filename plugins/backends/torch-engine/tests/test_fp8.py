"""FP8 rollout weights: blockwise e4m3 quantizer bounds, scale shapes, edge blocks, FP8 engine forward."""
import pytest
import torch
from miles import SamplingParams
from miles_plugin_torch_engine.fp8 import BLOCK, FP8Linear, dequantize_blockwise, quantize_blockwise

TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
        "initializer_range": 0.1}


def _blocks(x: torch.Tensor):
    for i in range(0, x.shape[0], BLOCK):
        for j in range(0, x.shape[1], BLOCK):
            yield (i // BLOCK, j // BLOCK), (slice(i, i + BLOCK), slice(j, j + BLOCK))


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (130, 7), (1, 1)])
def test_error_is_within_an_e4m3_step_of_each_blocks_amax(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of very different sizes
    q, s = quantize_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.dtype == torch.float32
    err = (dequantize_blockwise(q, s) - w).abs()
    for _, (r, c) in _blocks(w):
        assert err[r, c].max() <= w[r, c].abs().max() / 16


@pytest.mark.parametrize("shape,scales", [((128, 128), (1, 1)), ((300, 200), (3, 2)), ((129, 257), (2, 3)),
                                          ((64, 1000), (1, 8))])
def test_one_scale_per_128x128_block(shape, scales):
    _, s = quantize_blockwise(torch.randn(shape))
    assert tuple(s.shape) == scales


def test_edge_blocks_get_their_own_scale():
    torch.manual_seed(0)
    w = torch.randn(130, 140)
    w[128:, :] *= 1e-4  # the two edge rows are tiny: a scale shared with the big rows would zero them
    q, s = quantize_blockwise(w)
    back = dequantize_blockwise(q, s)
    assert s[1, 0] < s[0, 0] * 1e-2
    rel = (back[128:] - w[128:]).abs().max() / w[128:].abs().max()
    assert 0 < rel <= 1 / 16
    # the block's largest value maps to the largest e4m3 value (no range wasted)
    assert q[:128, :128].float().abs().max() == 448.0


def test_an_all_zero_block_stays_zero():
    w = torch.zeros(200, 200)
    w[:128, :128] = 1.0
    q, s = quantize_blockwise(w)
    assert torch.equal(dequantize_blockwise(q, s), w)


def test_fp8_linear_matches_the_dequantized_reference():
    lin = torch.nn.Linear(200, 300)
    fp8 = FP8Linear(lin)
    x = torch.randn(4, 200)
    ref = torch.nn.functional.linear(x, dequantize_blockwise(fp8.weight, fp8.weight_scale_inv), lin.bias)
    assert torch.allclose(fp8(x), ref, atol=1e-5)
    assert (fp8(x) - lin(x)).abs().max() < 0.1 * lin(x).abs().max()


def _activations_quantized(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as the FP8 GEMM path rounds it: e4m3 per token and 128-column group."""
    out = torch.empty_like(x)
    for j in range(0, x.shape[1], BLOCK):
        xs = x[:, j:j + BLOCK]
        scale = xs.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        out[:, j:j + BLOCK] = (xs / scale).to(torch.float8_e4m3fn).float() * scale
    return out


@pytest.mark.parametrize("shape", [(4, 200, 300), (3, 64, 160), (5, 384, 129)])
def test_fp8_gemms_equal_the_product_of_the_rounded_operands(shape):
    """torch._scaled_mm on e4m3 activations and weights: the exact product of the two rounded
    operands (up to float32 accumulation), for edge blocks of both too."""
    from miles_plugin_torch_engine.fp8 import fp8_linear

    T, K, N = shape
    torch.manual_seed(0)
    x, w = torch.randn(T, K), torch.randn(N, K) * 0.05
    q, s = quantize_blockwise(w)
    got = fp8_linear(x, q, s)
    want = _activations_quantized(x) @ dequantize_blockwise(q, s).t()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    exact = x @ w.t()
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()  # within e4m3 rounding of both


def test_fp8_linear_on_fp8_gemms_keeps_leading_dims_and_bias():
    lin = torch.nn.Linear(200, 300)
    fp8 = FP8Linear(lin)
    fp8.gemm = "scaled_mm"
    x = torch.randn(2, 3, 200)  # leading dims are kept
    y = fp8(x)
    assert y.shape == (2, 3, 300)
    want = _activations_quantized(x.reshape(6, 200)) @ dequantize_blockwise(fp8.weight, fp8.weight_scale_inv).t()
    assert torch.allclose(y.reshape(6, 300), want + lin.bias.detach(), atol=1e-5)


def engine(weights_dtype, dtype="bfloat16", device="cpu"):
    from miles_plugin_arith.env import char_tokenizer
    from miles_plugin_hf.config import HFModelConfig
    from miles_plugin_hf.spec import HFModelSpec
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    tok = char_tokenizer()
    torch.manual_seed(0)
    spec = HFModelSpec(HFModelConfig(config=TINY))
    master = spec.build_model(tok)
    eng = TorchEngine(TorchEngineConfig(dtype=dtype, weights_dtype=weights_dtype, device=device), spec=spec,
                      tokenizer=tok)
    eng.load_weights(master.state_dict().items(), 1)
    return eng, master, tok


def test_fp8_engine_forward_is_close_to_bf16_and_syncs_quantize():
    fp8, master, tok = engine("fp8")
    bf16, _, _ = engine("model")
    q = fp8.model.model.layers[0].self_attn.q_proj
    assert q.weight.dtype == torch.float8_e4m3fn and q.gemm == "scaled_mm"  # FP8 GEMMs on CPU
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" in fp8._targets
    # the synced weight is the blockwise quantization of the trainer's master weight
    want, scale = quantize_blockwise(master.model.layers[0].self_attn.q_proj.weight.detach())
    assert torch.equal(q.weight.view(torch.uint8), want.view(torch.uint8)) and torch.equal(q.weight_scale_inv, scale)
    ids = torch.tensor([tok("12+34=57")["input_ids"]])
    with torch.no_grad():
        a = torch.log_softmax(fp8.model(input_ids=ids).logits.float(), -1)
        b = torch.log_softmax(bf16.model(input_ids=ids).logits.float(), -1)
        exact = torch.log_softmax(master(input_ids=ids).logits.float(), -1)
    fp8_err, bf16_err = (a - exact).abs().mean(), (b - exact).abs().mean()
    # FP8 is coarser than bf16, but close: mean |logp error| over a 60-token vocabulary
    assert 0 < fp8_err < 0.1 and fp8_err > bf16_err, (fp8_err, bf16_err)
    out = fp8.generate([ids[0].tolist()[:6]], SamplingParams(max_new_tokens=3))
    assert len(out[0][0].token_ids) == 3


def test_prequantized_weights_are_taken_as_they_are():
    fp8, master, _ = engine("fp8", dtype="float32")
    w = master.model.layers[1].mlp.up_proj.weight.detach() * 2
    q, s = quantize_blockwise(w)
    fp8.load_weights([("model.layers.1.mlp.up_proj.weight", q),
                      ("model.layers.1.mlp.up_proj.weight_scale_inv", s)], 2)
    layer = fp8.model.model.layers[1].mlp.up_proj
    assert torch.equal(layer.weight_scale_inv, s) and fp8.weight_version == 2
    from miles_plugin_torch_engine.config import TorchEngineConfig

    with pytest.raises(ValueError, match="weights_dtype=fp8"):
        TorchEngineConfig(weights_dtype="fp8", impl="fast")


def test_weight_update_api_quantizes_too():
    """The SGLang-style update paths (distributed, tensor handoff, disk) copy through _assign_all."""
    fp8, master, _ = engine("fp8", dtype="float32")
    w = master.model.layers[0].mlp.gate_proj.weight.detach() * 3
    fp8._assign_all([("model.layers.0.mlp.gate_proj.weight", w)])
    layer = fp8.model.model.layers[0].mlp.gate_proj
    want, scale = quantize_blockwise(w)
    assert torch.equal(layer.weight.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, scale)


# -- mixture-of-experts weights: 3-D [experts, out, in], quantized per expert -------------------------

MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 160,
       "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 32,
       "initializer_range": 0.1}


@pytest.mark.parametrize("halves", [1, 2])
def test_expert_weights_are_quantized_per_expert_and_block(halves):
    torch.manual_seed(0)
    w = torch.randn(3, 320, 200)
    w[1] *= 1e-3  # a small expert: a scale shared with the others would flatten it
    w[2, 160:] *= 1e2  # the up half of expert 2 is large
    q, s = quantize_blockwise(w, halves=halves)
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn
    # fused gate/up blocked per half: 2 x ceil(160/128) rows; as one matrix: ceil(320/128)
    assert tuple(s.shape) == ((3, 4, 2) if halves == 2 else (3, 3, 2))
    back = dequantize_blockwise(q, s, halves=halves)
    for e in range(3):
        for h in range(halves):
            rows = slice(h * 320 // halves, (h + 1) * 320 // halves)
            ref, got = w[e, rows], back[e, rows]
            qe, se = quantize_blockwise(ref)  # each expert (half) alone: the same blocks and scales
            assert torch.equal(se, s[e, h * se.shape[0]:(h + 1) * se.shape[0]])
            assert torch.equal(dequantize_blockwise(qe, se), got)
            for _, (r, c) in _blocks(ref):
                assert (got[r, c] - ref[r, c]).abs().max() <= ref[r, c].abs().max() / 16
    assert s[1].max() < s[0].min() * 0.1


def test_expert_edge_half_gets_its_own_scale():
    w = torch.ones(1, 200, 64)  # gate rows 0..99, up rows 100..199: each half is one edge block
    w[0, 100:] = 1e-3
    q, s = quantize_blockwise(w, halves=2)
    assert tuple(s.shape) == (1, 2, 1) and torch.allclose(s[0, :, 0], torch.tensor([1 / 448, 1e-3 / 448]))
    assert torch.allclose(dequantize_blockwise(q, s, halves=2), w, rtol=1e-6)
    with pytest.raises(ValueError, match="halves"):
        quantize_blockwise(torch.ones(1, 201, 64), halves=2)


def moe_engine(weights_dtype, dtype="float32", **kw):
    from miles_plugin_arith.env import char_tokenizer
    from miles_plugin_hf.config import HFModelConfig
    from miles_plugin_hf.spec import HFModelSpec
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    tok = char_tokenizer()
    torch.manual_seed(0)
    spec = HFModelSpec(HFModelConfig(config=MOE))
    master = spec.build_model(tok).eval()
    eng = TorchEngine(TorchEngineConfig(dtype=dtype, weights_dtype=weights_dtype, impl="hf", **kw), spec=spec,
                      tokenizer=tok)
    eng.load_weights(master.state_dict().items(), 1)
    return eng, master, tok


def _routed(tokens: int = 7):
    torch.manual_seed(1)
    idx = torch.tensor([[0, 3], [1, 2], [3, 0], [2, 2], [0, 1], [1, 3], [2, 0]])[:tokens]
    return torch.randn(tokens, 64), idx, torch.rand(tokens, 2)


def test_fp8_engine_runs_the_experts_on_fp8_weights():
    from miles_plugin_torch_engine.fp8 import FP8Experts

    fp8, master, tok = moe_engine("fp8")
    experts = fp8.model.model.layers[1].mlp.experts
    assert isinstance(experts, FP8Experts) and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    scales = {n: tuple(t.shape) for n, t in fp8._targets.items() if n.startswith("model.layers.1.mlp.experts.")}
    assert scales["model.layers.1.mlp.experts.gate_up_proj_scale_inv"] == (4, 4, 1)  # 2 halves x ceil(160/128)
    assert scales["model.layers.1.mlp.experts.down_proj_scale_inv"] == (4, 1, 2)
    assert set(scales) == {f"model.layers.1.mlp.experts.{a}{s}" for a in ("gate_up_proj", "down_proj")
                           for s in ("", "_scale_inv")}  # the held experts module adds no names
    assert fp8.model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # routers stay unquantized
    want, scale = quantize_blockwise(master.model.layers[1].mlp.experts.down_proj.detach())
    assert torch.equal(experts.down_proj.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(experts.down_proj_scale_inv, scale)
    # weight-only in both GEMM modes: the reference experts' function on the dequantized weights
    ref = master.model.layers[1].mlp.experts
    h, idx, wts = _routed()
    with torch.no_grad():
        saved = ref.gate_up_proj.clone(), ref.down_proj.clone()
        ref.gate_up_proj.copy_(experts.dequantized("gate_up_proj", torch.float32))
        ref.down_proj.copy_(experts.dequantized("down_proj", torch.float32))
        assert experts.gemm == "scaled_mm"  # engine.fp8_gemm auto, on CPU
        assert torch.equal(experts(h, idx, wts), ref(h, idx, wts))
        experts.gemm = "dequantized"
        assert torch.equal(experts(h, idx, wts), ref(h, idx, wts))
        experts.gemm = "scaled_mm"
        ref.gate_up_proj.copy_(saved[0])
        ref.down_proj.copy_(saved[1])
        ids = torch.tensor([tok("12+34=57")["input_ids"]])
        exact = torch.log_softmax(master(input_ids=ids).logits.float(), -1)
        got = torch.log_softmax(fp8.model(input_ids=ids).logits.float(), -1)
    err = (got - exact).abs().mean()
    assert 1e-4 < err < 0.1, err
    out = fp8.generate([ids[0].tolist()[:6]], SamplingParams(max_new_tokens=3))
    assert len(out[0][0].token_ids) == 3


@pytest.mark.parametrize("fmt", ["fp8", "int4", "mxfp8"])
def test_moe_engine_computes_what_the_trainer_computes(fmt):
    """The engine's experts equal the trainer's rounded experts (``RoundedExperts``) on the same
    weights, and its log-probs a trainer forward with the same rounding."""
    import copy

    from miles_lowp.linear import RoundedExperts, packed_weights, served_weights
    from miles_lowp.linear import convert as convert_trainer

    eng, master, tok = moe_engine(fmt, **({"fp8_gemm": "dequantized"} if fmt == "fp8" else {}))
    trainer = copy.deepcopy(master)
    formats = convert_trainer(trainer, qat="int4") if fmt == "int4" else convert_trainer(trainer, fmt)
    assert isinstance(trainer.model.layers[0].mlp.experts, RoundedExperts)
    assert formats["model.layers.0.mlp.experts.gate_up_proj"] == fmt
    eng.load_weights(packed_weights(trainer.state_dict().items(), formats), 2)  # as a sync sends them
    h, idx, wts = _routed()
    ids = torch.tensor([tok("12+34=57")["input_ids"]])
    with torch.no_grad():
        for layer in range(2):
            got = eng.model.model.layers[layer].mlp.experts(h, idx, wts)
            assert torch.equal(got, trainer.model.layers[layer].mlp.experts(h, idx, wts)), layer
        got = torch.log_softmax(eng.model(input_ids=ids).logits.float(), -1)
        if fmt == "fp8":  # weight-only FP8 linears: the master model holding the served weights
            served = copy.deepcopy(master)
            served.load_state_dict(dict(served_weights(master.state_dict().items(), formats)))
            want = torch.log_softmax(served(input_ids=ids).logits.float(), -1)
        else:  # the trainer's own forward (mxfp8 linears round the activations on both sides)
            want = torch.log_softmax(trainer(input_ids=ids).logits.float(), -1)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_prequantized_expert_weights_are_taken_and_bad_shapes_refused():
    fp8, master, _ = moe_engine("fp8")
    w = master.model.layers[0].mlp.experts.gate_up_proj.detach() * 2
    q, s = quantize_blockwise(w, halves=2)
    fp8.load_weights([("model.layers.0.mlp.experts.gate_up_proj", q),
                      ("model.layers.0.mlp.experts.gate_up_proj_scale_inv", s)], 2)
    experts = fp8.model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj_scale_inv, s)
    assert torch.equal(experts.gate_up_proj.view(torch.uint8), q.view(torch.uint8))
    with pytest.raises(ValueError, match="gate_up_proj_scale_inv"):
        fp8.load_weights([("model.layers.0.mlp.experts.gate_up_proj_scale_inv", s[:, :3])], 3)


# -- CUDA: FP8 GEMMs on the GPU (torch._scaled_mm with rowwise scales) --------------------------------

def _fp8_gemms_on_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8_gpu = pytest.mark.skipif(not _fp8_gemms_on_cuda(), reason="FP8 GEMMs need a CUDA GPU of capability >= 8.9")


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("shape", [(1, 128, 128), (5, 200, 300), (3, 64, 40), (33, 1024, 384), (7, 384, 129)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fp8_linear_is_within_e4m3_rounding_of_the_dequantized_matmul(shape, dtype):
    """On CUDA, against the float32 product with the dequantized weight: every output within the
    sound bound of rounding the activations to e4m3 (3 mantissa bits: relative error <= 2^-4, or
    half the subnormal step of the token's group scale), plus bfloat16 rounding of each group's
    partial sum and of the output (2^-8 each, with room: 2^-6 in all). Edge blocks: K and N not
    multiples of 128 (nor N of 16)."""
    from miles_plugin_torch_engine.fp8 import fp8_linear

    T, K, N = shape
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(T, K, generator=g) * torch.logspace(-2, 1, K)).to(dtype).float()  # columns of varied size
    w = torch.randn(N, K, generator=g) * 0.05
    q, s = quantize_blockwise(w)
    wq = dequantize_blockwise(q, s)
    ref = x @ wq.t()
    got = fp8_linear(x.to("cuda", dtype), q.cuda(), s.cuda())
    assert got.dtype == dtype and got.shape == (T, N)
    got = got.float().cpu()
    # an e4m3 subnormal step is 2^-9 of the group's scale (amax / 448): its half bounds the rest
    amax = torch.nn.functional.pad(x.abs(), (0, -K % BLOCK)).view(T, -1, BLOCK).amax(-1)
    floor = (amax / 448 * 2 ** -10).repeat_interleave(BLOCK, -1)[:, :K]
    bound = (2 ** -4 + 2 ** -6) * (x.abs() @ wq.abs().t()) + floor @ wq.abs().t()
    err = (got - ref).abs()
    assert torch.isfinite(got).all() and (err <= bound).all(), float((err / bound).max())
    # and it is the product of the same rounded operands as on CPU, up to the bfloat16 partials
    rounded = _activations_quantized(x) @ wq.t()
    assert ((got - rounded).abs() <= 2 ** -6 * (x.abs() @ wq.abs().t()) + 1e-6).all()
    # a wrong layout or scale would be off by the whole product, not by a rounding step
    assert (err.norm() / ref.norm()) < 2 ** -4


@pytest.mark.gpu
@needs_fp8_gpu
def test_gpu_fp8_engine_generates_like_the_bf16_engine():
    """A tiny model on CUDA with FP8 weights (FP8 GEMMs, bf16 activations): finite log-probs, and
    greedy tokens that mostly match the bf16 engine's. This random model's next-token choices are
    often near ties (FP8's log-prob error is a few tenths at most), so: most free-running tokens
    match (an early flip can change a row's rest), most teacher-forced choices match, and every
    choice the bf16 engine makes by more than 0.5 nats is FP8's too."""
    fp8, master, tok = engine("fp8", device="cuda")
    bf16, _, _ = engine("model", device="cuda")
    q = fp8.model.model.layers[0].self_attn.q_proj
    assert q.weight.is_cuda and q.weight.dtype == torch.float8_e4m3fn and q.gemm == "scaled_mm"
    pairs = [(a, b) for a in range(10, 99, 7) for b in range(13, 99, 29)][:32]
    prompts = [tok(f"{a}+{b}=", add_special_tokens=False)["input_ids"] for a, b in pairs]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    got = [g[0] for g in fp8.generate(prompts, params)]
    want = [g[0] for g in bf16.generate(prompts, params)]
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in got)
    assert all(torch.isfinite(torch.tensor(c.logprobs)).all() for c in got)
    same = [a == b for c, d in zip(got, want) for a, b in zip(c.token_ids, d.token_ids)]
    first = sum(c.token_ids[0] == d.token_ids[0] for c, d in zip(got, want))
    assert first >= 0.75 * len(prompts) and sum(same) >= 0.7 * len(same), (first, sum(same), len(same))
    agree, margin = [], []
    with torch.no_grad():
        for p, d in zip(prompts, want):
            ids = torch.tensor([p + d.token_ids[:-1]], device="cuda")
            a = fp8.model(input_ids=ids).logits[0, len(p) - 1:].float()
            b = bf16.model(input_ids=ids).logits[0, len(p) - 1:].float().log_softmax(-1)
            top = b.topk(2, -1).values
            agree.append(a.argmax(-1) == b.argmax(-1))
            margin.append(top[:, 0] - top[:, 1])
    agree, margin = torch.cat(agree), torch.cat(margin)
    assert agree.float().mean() >= 0.8 and agree[margin > 0.5].all(), (agree.float().mean(), margin[~agree])
