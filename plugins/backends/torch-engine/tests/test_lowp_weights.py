"""INT4 and MXFP8 rollout weights: packed storage, packed or full-precision syncs, and a forward
equal to the trainer's (the master model with the same rounding)."""
import copy

import pytest
import torch
from miles import SamplingParams
from miles.testing import char_tokenizer
from miles_lowp import int4 as i4
from miles_lowp import mx
from miles_lowp.linear import convert as convert_trainer
from miles_lowp.linear import packed_weights

TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
        "initializer_range": 0.1}


def engine(weights_dtype, **kw):
    from miles_plugin_hf.config import HFModelConfig
    from miles_plugin_hf.spec import HFModelSpec
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    tok = char_tokenizer()
    torch.manual_seed(0)
    spec = HFModelSpec(HFModelConfig(config=TINY))
    master = spec.build_model(tok)
    eng = TorchEngine(TorchEngineConfig(weights_dtype=weights_dtype, **kw), spec=spec, tokenizer=tok)
    return eng, master, tok


def logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), -1)


@pytest.mark.parametrize("fmt", ["int4", "mxfp8"])
def test_engine_serves_what_the_trainer_computes_with(fmt):
    eng, master, tok = engine(fmt)
    trainer = copy.deepcopy(master)
    formats = convert_trainer(trainer, qat="int4") if fmt == "int4" else convert_trainer(trainer, "mxfp8")
    assert "model.layers.0.self_attn.q_proj.weight" in formats and "lm_head.weight" not in formats
    # the trainer sends packed weights; the engine copies them as they are
    sent = dict(packed_weights(trainer.state_dict().items(), formats))
    eng.load_weights(sent.items(), 1)
    q = eng.model.model.layers[0].self_attn.q_proj
    if fmt == "int4":
        assert q.weight_packed.dtype == torch.uint8 and q.weight_packed.shape == (64, 32)
        assert q.weight_scale.shape == (64, 1)  # 64 columns: one (short) group of 128
        assert "model.layers.0.self_attn.q_proj.weight_packed" in sent
    else:
        assert q.weight.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (64, 2)
    ids = torch.tensor([tok("12+34=57")["input_ids"]])
    got, want = logprobs(eng.model, ids), logprobs(trainer, ids)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    exact = logprobs(master, ids)
    # rounded, but near the master model (16 INT4 levels move a random-init model's log-probs more)
    assert 0 < float((got - exact).abs().mean()) < (0.5 if fmt == "int4" else 0.1)

    # full-precision weights are quantized on arrival into the same buffers
    fresh, _, _ = engine(fmt)
    fresh.load_weights(master.state_dict().items(), 1)
    assert torch.allclose(logprobs(fresh.model, ids), got, atol=1e-6)
    out = fresh.generate([ids[0].tolist()[:6]], SamplingParams(max_new_tokens=3))
    assert len(out[0][0].token_ids) == 3


def test_int4_buffers_are_the_rounded_master_weights():
    eng, master, _ = engine("int4")
    w = master.model.layers[1].mlp.down_proj.weight.detach() * 2
    eng._assign_all([("model.layers.1.mlp.down_proj.weight", w)])  # the SGLang-style update paths
    layer = eng.model.model.layers[1].mlp.down_proj
    packed, scale = i4.quantize_packed(w)
    assert torch.equal(layer.weight_packed, packed) and torch.equal(layer.weight_scale, scale)
    assert torch.equal(layer.dequantized("weight", torch.float32), i4.qdq_int4(w))
    with pytest.raises(ValueError, match="has shape"):
        eng.load_weights([("model.layers.1.mlp.down_proj.weight_packed", torch.zeros(3, 3, dtype=torch.uint8))], 2)


def test_mxfp8_scales_are_e8m0_bytes():
    eng, master, _ = engine("mxfp8")
    eng.load_weights(master.state_dict().items(), 1)
    layer = eng.model.model.layers[0].mlp.up_proj
    q, biased = mx.quantize_mx(master.model.layers[0].mlp.up_proj.weight.detach())
    assert layer.weight_scale.dtype == torch.uint8 and torch.equal(layer.weight_scale, biased)
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))


def test_expert_scope_and_fast_path_refusal():
    from miles_plugin_torch_engine.config import TorchEngineConfig

    with pytest.raises(ValueError, match="weights_dtype=int4 runs the model's own forward"):
        TorchEngineConfig(weights_dtype="int4", impl="fast")
    eng, _, _ = engine("int4", quant_scope="experts")  # a dense model has no experts: nothing converted
    assert type(eng.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
