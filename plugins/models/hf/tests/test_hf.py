import pytest
import torch
from pydantic import ValidationError

from miles.testing import char_tokenizer
from miles_plugin_hf.config import HFModelConfig
from miles_plugin_hf.spec import HFModelSpec

TINY = {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1}


def test_inline_config_uses_the_tokenizer_vocab():
    tok = char_tokenizer()
    model = HFModelSpec(HFModelConfig(config=TINY)).build_model(tok)
    assert model.config.vocab_size == len(tok) and model.config.pad_token_id == tok.pad_token_id


def test_local_folder_roundtrip(tmp_path):
    tok = char_tokenizer()
    spec = HFModelSpec(HFModelConfig(config=TINY))
    model = spec.build_model(tok)
    spec.save_pretrained(model.state_dict().items(), tok, str(tmp_path / "m"))
    loaded = HFModelSpec(HFModelConfig(path=str(tmp_path / "m")))
    tok2 = loaded.build_tokenizer()
    assert tok2.encode("12+3") == tok.encode("12+3")
    m2 = loaded.build_model(tok2)
    ids = torch.tensor([[4, 5, 6]])
    assert torch.equal(m2(ids).logits, model(ids).logits)


def test_config_errors_say_what_to_do(tmp_path):
    with pytest.raises(ValidationError, match="exactly one of model.path"):
        HFModelConfig()
    with pytest.raises(ValidationError, match="is not a folder"):
        HFModelConfig(path=str(tmp_path / "missing"))
    with pytest.raises(ValidationError, match="model_type"):
        HFModelConfig(config={"hidden_size": 8})


def test_registration_is_lazy():
    from miles.testing import assert_lazy_registration

    assert_lazy_registration("miles_plugin_hf", "model_specs", "hf")


@pytest.mark.parametrize("bad, says", [
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"hidden_size": 30}, "hidden_size (30) must be a multiple of 2 x num_attention_heads (2)"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4}, "multiple of num_key_value_heads (3)"),
    ({"model_type": "qwen"}, "'qwen' is not a transformers model type (closest: qwen"),
])
def test_inline_config_problems_are_caught_before_building(bad, says):
    with pytest.raises(ValidationError) as e:
        HFModelConfig(config={**TINY, **bad})
    assert says in str(e.value) and len(str(e.value)) < 600


def test_vocab_smaller_than_the_tokenizer_is_a_clear_error():
    from miles import MilesError

    with pytest.raises(MilesError, match="vocab_size \\(5\\) is smaller than the tokenizer's"):
        HFModelSpec(HFModelConfig(config={**TINY, "vocab_size": 5})).build_model(char_tokenizer())


def test_save_pretrained_never_overwrites_a_folder(tmp_path):
    from miles import MilesError

    tok = char_tokenizer()
    spec = HFModelSpec(HFModelConfig(config=TINY))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(MilesError, match="not an empty folder"):
        spec.save_pretrained(spec.build_model(tok).state_dict().items(), tok, str(tmp_path / "m"))
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["notes.txt"]
