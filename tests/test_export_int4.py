"""miles export of an INT4 QAT run: a compressed-tensors folder (packed INT4, a quarter of the dense
size) that transformers loads and whose logits are the torch engine's, the engine fed the trainer's
packed weights as rollout syncs them; the folder also loads as a model to train on (``model.path``)
and to serve (``miles serve``), as the dense export does."""
import json
from pathlib import Path

import torch
from miles import SamplingParams
from miles.cli import load, main
from miles.loop import Loop
from miles.runfolder import latest

ROOT = Path(__file__).resolve().parents[1]
# one QAT step of a model whose linear layers' rows are 128 long (the format's group)
QAT_RUN = ["run.steps=1", "run.eval_every=1", "run.checkpoint_every=1", "env.eval_size=2", "loggers=[]",
           "run.warm_start=null", "rollout.batch_size=4", "algorithm.filter_zero_variance=false", "trainer.qat=int4",
           "engine.weights_dtype=int4", "model.config.hidden_size=128", "model.config.intermediate_size=256"]


def test_a_qat_run_exports_the_int4_model_the_engine_served(tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    assert main(["train", str(ROOT / "tests/tiny.yaml"), f"run.out_dir={run}", *QAT_RUN]) == 0
    assert main(["export", str(run), "--to", str(tmp_path / "int4")]) == 0  # auto: compressed-tensors
    assert main(["export", str(run), "--to", str(tmp_path / "dense"), "--format", "dense"]) == 0
    size = {k: (tmp_path / k / "model.safetensors").stat().st_size for k in ("int4", "dense")}
    assert size["int4"] < 0.3 * size["dense"], size
    q = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "pack-quantized")
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())

    loop = Loop(*load(str(run / "config.yaml"), [f"run.out_dir={run}"], []))
    engine = loop.build().engine
    engine.load_weights(loop.new_trainer(latest(str(run))).packed_weights(), 1)
    ids = torch.tensor([loop.components.tokenizer("3+4=7")["input_ids"]])
    with torch.no_grad():
        want = engine.model(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "int4")(input_ids=ids).logits
        dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert torch.allclose(dense, want, atol=1e-5, rtol=0), (dense - want).abs().max()

    # the folder as a model to train on (model.path) and to serve (miles serve): plain linear layers
    from miles_plugin_hf.config import HFModelConfig
    from miles_plugin_hf.spec import HFModelSpec
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine
    from miles_plugin_torch_engine.server import FolderSpec

    spec = HFModelSpec(HFModelConfig(path=str(tmp_path / "int4")))
    model = spec.build_model(loop.components.tokenizer)
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, torch.nn.Parameter)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, want, atol=1e-5, rtol=0)
    outs = []
    for folder in ("int4", "dense"):
        served = FolderSpec(str(tmp_path / folder))
        tok = served.build_tokenizer()
        server = TorchEngine(TorchEngineConfig(), spec=served, tokenizer=tok)
        outs.append(server.generate([tok("3+4=")["input_ids"]], SamplingParams(temperature=0.0, max_new_tokens=3)))
    assert outs[0][0][0].token_ids == outs[1][0][0].token_ids
    assert torch.allclose(torch.tensor(outs[0][0][0].logprobs), torch.tensor(outs[1][0][0].logprobs), atol=1e-5)
