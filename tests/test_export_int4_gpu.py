"""On a CUDA GPU: INT4 weights held on the GPU pack as the CPU packs them, and a compressed-tensors
folder loaded by transformers in bfloat16 on the GPU gives the torch engine's log-probs, the engine
serving the folder as INT4 through its Triton W4A16 GEMM."""
import copy

import pytest
import torch
from miles_lowp.compressed import compress_folder, compress_weight
from miles_lowp.linear import convert, served_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONFIG = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32}


def test_cuda_weights_pack_as_cpu_ones():
    torch.manual_seed(0)
    w = torch.randn(384, 512)
    cpu, gpu = compress_weight(w), compress_weight(w.cuda())
    assert all(torch.equal(cpu[k], gpu[k]) for k in cpu)


def test_the_folder_on_cuda_gives_the_engines_w4a16_logprobs(tmp_path):
    from miles.testing import char_tokenizer
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine
    from miles_plugin_torch_engine.server import FolderSpec
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

    torch.manual_seed(0)
    master = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **CONFIG))
    formats = convert(copy.deepcopy(master), qat="int4")
    served = copy.deepcopy(master)
    served.load_state_dict(dict(served_weights(master.state_dict().items(), formats)))
    served.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    compress_folder(tmp_path, master.state_dict().items(), formats)

    spec = FolderSpec(str(tmp_path))
    engine = TorchEngine(TorchEngineConfig(device="cuda", dtype="bfloat16", weights_dtype="int4"), spec=spec,
                         tokenizer=spec.build_tokenizer())
    assert engine.model.model.layers[0].self_attn.q_proj.weight_packed.is_cuda
    ids = torch.randint(0, 64, (2, 12), device="cuda")
    # use_kernels=False: transformers would otherwise fetch hub kernels for a CUDA device map
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cuda", use_kernels=False,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        want = torch.log_softmax(engine.model(input_ids=ids).logits.float(), -1)
        got = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    # the same INT4 weights; bfloat16 activations summed in other orders (Triton against cuBLAS)
    assert float((got - want).abs().mean()) < 2e-2, float((got - want).abs().max())
