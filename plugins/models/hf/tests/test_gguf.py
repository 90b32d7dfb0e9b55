"""model.gguf_file: a GGUF file loads through transformers' GGUF loader (weights, tokenizer, chat
template) and saves as a plain safetensors folder that transformers loads back unchanged."""
import pytest
import torch
from pydantic import ValidationError

from miles_plugin_hf.config import HFModelConfig
from miles_plugin_hf.spec import HFModelSpec


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    from miles_tinypolicy.gguf import write_gguf

    folder = tmp_path_factory.mktemp("gguf")
    _, source = write_gguf(folder)
    return folder, source


def test_gguf_model_tokenizer_and_template(gguf_folder):
    folder, source = gguf_folder
    spec = HFModelSpec(HFModelConfig(path=str(folder), gguf_file="tiny.gguf"))
    tok = spec.build_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi 12+3"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert tok.decode(ids) == "<|im_start|>user\nhi 12+3<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    model = spec.build_model(tok)
    x = torch.tensor([ids])
    # q/k rows come back from llama.cpp's layout: the same function as the model that was written
    assert torch.allclose(model(x).logits, source(x).logits, atol=1e-5)
    assert spec.model_type() == "llama"


def test_gguf_model_exports_a_folder_transformers_loads(gguf_folder, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _ = gguf_folder
    spec = HFModelSpec(HFModelConfig(path=str(folder), gguf_file="tiny.gguf"))
    tok = spec.build_tokenizer()
    model = spec.build_model(tok)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # a trained weight, not the file's
    spec.save_pretrained(model.state_dict().items(), tok, str(tmp_path / "out"))
    assert (tmp_path / "out" / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "out")
    x = torch.tensor([tok.encode("the 12")])
    assert torch.equal(loaded(x).logits, model(x).logits)
    assert tok2.encode("the 12") == tok.encode("the 12") and tok2.chat_template == tok.chat_template
    assert getattr(loaded.config, "quantization_config", None) is None


def test_gguf_config_errors_name_the_fix(gguf_folder, tmp_path):
    folder, _ = gguf_folder
    with pytest.raises(ValidationError, match=r"'other.gguf' is not in .* \(GGUF files there: tiny.gguf\)"):
        HFModelConfig(path=str(folder), gguf_file="other.gguf")
    with pytest.raises(ValidationError, match="must be the name of a .gguf file inside model.path"):
        HFModelConfig(path=str(folder), gguf_file="../tiny.gguf")
    with pytest.raises(ValidationError, match="needs model.path"):
        HFModelConfig(config={"model_type": "llama"}, gguf_file="tiny.gguf")


def test_package_path_resolves_an_installed_package_without_importing_it(tmp_path, monkeypatch):
    # a package whose import fails (as one whose runtime is not installed would): found, not imported
    (tmp_path / "ships_weights").mkdir()
    (tmp_path / "ships_weights" / "__init__.py").write_text("raise ImportError('heavy runtime missing')")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = HFModelConfig(path="package:ships_weights")
    assert cfg.folder == str(tmp_path / "ships_weights") and cfg.path == "package:ships_weights"
    with pytest.raises(ValidationError, match="no installed package 'no_such_pkg_x'; install the package"):
        HFModelConfig(path="package:no_such_pkg_x")
