"""INT4 weights rewritten in the compressed-tensors format: the packing against the format's
definition (value ``i`` of a row in bits ``4i..4i+3`` of int32 word ``i // 8``, stored as ``v + 8``),
and a folder transformers loads with the very values the engines serve, sharded or not; a weight
the format cannot hold is refused before any file changes."""
import copy
import hashlib
import json

import pytest
import torch
from miles_lowp import int4 as i4
from miles_lowp.compressed import CompressedExportError, compress_folder, compress_weight
from miles_lowp.linear import convert, served_weights

CONFIG = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 48, "max_position_embeddings": 16}


def test_packing_follows_the_format_definition():
    torch.manual_seed(0)
    w = torch.randn(3, 256)
    out = compress_weight(w)
    q, scale = i4.quantize_int4(w)
    assert out["weight_packed"].dtype == torch.int32 and out["weight_packed"].shape == (3, 32)
    assert torch.equal(out["weight_scale"], scale) and out["weight_shape"].tolist() == [3, 256]
    nibbles = (q.to(torch.int64) + 8).view(3, 32, 8)
    words = sum(nibbles[..., j] << (4 * j) for j in range(8))
    want = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # two's complement
    assert torch.equal(out["weight_packed"], want)
    with pytest.raises(CompressedExportError, match="multiple of 128"):
        compress_weight(torch.randn(4, 96))


def served_folder(tmp_path, config, shard=None):
    """A dense Hugging Face folder of the served (INT4-rounded) weights, the full-precision ones and
    the formats, as ``miles export`` has them before packing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen2", **config)
    master = AutoModelForCausalLM.from_config(cfg)
    formats = convert(copy.deepcopy(master), qat="int4")
    served = copy.deepcopy(master)
    served.load_state_dict(dict(served_weights(master.state_dict().items(), formats)))
    served.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    return master, served, formats


@pytest.mark.parametrize("shard", [None, "150KB"])
def test_transformers_loads_the_served_values(tmp_path, shard):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    master, served, formats = served_folder(tmp_path, CONFIG, shard)
    dense = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert compress_folder(tmp_path, master.state_dict().items(), formats) == len(formats) == 7
    assert sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) < 0.5 * dense
    q = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["format"], q["ignore"]) == ("compressed-tensors", "pack-quantized", ["lm_head"])
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 128)
    if shard:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        names = index["weight_map"]
        assert len(set(names.values())) > 1 and "model.layers.0.mlp.down_proj.weight" not in names
        assert "model.layers.0.mlp.down_proj.weight_packed" in names
        from safetensors.torch import load_file

        sizes = sum(t.numel() * t.element_size() for f in tmp_path.glob("*.safetensors")
                    for t in load_file(f).values())
        assert index["metadata"]["total_size"] == sizes

    ids = torch.randint(0, 48, (2, 7))
    with torch.no_grad():
        want = served(ids).logits
        for kw in ({}, {"quantization_config": CompressedTensorsConfig(dequantize=True)}):
            got = AutoModelForCausalLM.from_pretrained(tmp_path, **kw)(ids).logits
            assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()
        assert not torch.allclose(master(ids).logits, want, atol=1e-3)  # the rounding is real


def test_a_weight_the_format_cannot_hold_changes_no_file(tmp_path):
    master, _, formats = served_folder(tmp_path, {**CONFIG, "hidden_size": 32, "intermediate_size": 64})
    before = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in tmp_path.iterdir()}
    with pytest.raises(CompressedExportError, match="multiple of 128"):
        compress_folder(tmp_path, master.state_dict().items(), formats)
    with pytest.raises(CompressedExportError, match="nn.Linear weights only, not model.layers.0.mlp.experts"):
        compress_folder(tmp_path, master.state_dict().items(), {"model.layers.0.mlp.experts.gate_up_proj": "int4"})
    with pytest.raises(CompressedExportError, match="holds INT4 weights; these are fp8"):
        compress_folder(tmp_path, master.state_dict().items(), dict.fromkeys(formats, "fp8"))
    assert {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in tmp_path.iterdir()} == before
