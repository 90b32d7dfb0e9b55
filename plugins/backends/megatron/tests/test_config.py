"""Config and layout validation: clear errors naming the key, before any model is built."""
import pytest
from helpers import hf_config
from miles import MilesError
from miles_plugin_megatron.arch import arch_of
from miles_plugin_megatron.config import MegatronConfig
from miles_plugin_megatron.parallel import check_layout
from pydantic import ValidationError


def test_defaults_and_unknown_key():
    cfg = MegatronConfig()
    assert (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.expert_parallel, cfg.precision) == (1, 1, 1, "bf16")
    with pytest.raises(ValidationError, match="tensor_paralel"):
        MegatronConfig(tensor_paralel=2)
    with pytest.raises(ValidationError, match="precision"):
        MegatronConfig(precision="fp16")


def test_world_not_divisible_by_tp_names_the_keys():
    with pytest.raises(MilesError, match=r"world size 3 is not divisible by trainer.tensor_parallel"):
        check_layout(MegatronConfig(tensor_parallel=2), arch_of(hf_config("llama")), world=3)


def test_tp_must_divide_heads_and_kv_groups():
    arch = arch_of(hf_config("llama", num_key_value_heads=2))
    with pytest.raises(MilesError, match=r"tensor_parallel=4 does not divide the model's 2 KV heads"):
        check_layout(MegatronConfig(tensor_parallel=4), arch, world=4)


def test_expert_parallel_rules():
    with pytest.raises(MilesError, match="expert_parallel=2 needs an MoE model"):
        check_layout(MegatronConfig(expert_parallel=2), arch_of(hf_config("qwen2")), world=2)
    with pytest.raises(MilesError, match="expert_parallel=3 does not divide the model's 4 experts"):
        check_layout(MegatronConfig(expert_parallel=3), arch_of(hf_config("qwen3_moe")), world=3)
    check_layout(MegatronConfig(expert_parallel=2), arch_of(hf_config("qwen3_moe")), world=2)


def test_pipeline_parallel_must_divide_the_layers():
    with pytest.raises(MilesError, match="pipeline_parallel=3 does not divide the model's 2 layers"):
        check_layout(MegatronConfig(pipeline_parallel=3), arch_of(hf_config("qwen2")), world=3)
    check_layout(MegatronConfig(pipeline_parallel=2), arch_of(hf_config("qwen2")), world=2)


def test_virtual_pipeline_stages_rules():
    with pytest.raises(MilesError, match="virtual_pipeline_parallel=2 interleaves pipeline stages: it needs "
                                         "trainer.pipeline_parallel >= 2"):
        check_layout(MegatronConfig(virtual_pipeline_parallel=2), arch_of(hf_config("qwen2")), world=1)
    with pytest.raises(MilesError, match=r"pipeline_parallel \* trainer.virtual_pipeline_parallel = 2 \* 2 "
                                         r"does not divide the model's 2 layers"):
        check_layout(MegatronConfig(pipeline_parallel=2, virtual_pipeline_parallel=2),
                     arch_of(hf_config("qwen2")), world=2)
    check_layout(MegatronConfig(pipeline_parallel=2, virtual_pipeline_parallel=2),
                 arch_of(hf_config("qwen2", num_hidden_layers=4)), world=2)


def test_unsupported_architecture_and_rope_scaling():
    from transformers import AutoConfig

    with pytest.raises(MilesError, match="model_type 'gpt2' is not supported"):
        arch_of(AutoConfig.for_model("gpt2"))
    scaled = hf_config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(MilesError, match="rope_parameters.rope_type 'linear' is not supported"):
        arch_of(scaled)


def test_registered_as_megatron_trainer():
    from miles.plugins import make_plugin_manager

    found = {}
    pm = make_plugin_manager()
    pm.hook.miles_register_trainers(register=lambda name, factory, config=None: found.update({name: config}))
    assert found.get("megatron") is MegatronConfig


def test_cuda_device_without_a_gpu_is_a_clear_error():
    import torch
    from miles_plugin_megatron.parallel import pick_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(MilesError, match="trainer.device=cuda: torch sees no CUDA GPU"):
        pick_device("cuda", 0, 1)
    with pytest.raises(ValidationError, match="device"):
        MegatronConfig(device="gpu")


def test_registration_imports_neither_torch_nor_megatron():
    from miles.testing import assert_lazy_registration

    assert_lazy_registration("miles_plugin_megatron", "trainers", "megatron")


def test_trainer_does_not_claim_exact_scoring():
    """Its scoring routine runs a Megatron model, not the engine's Hugging Face one."""
    from miles.protocols import ExactScoring
    from miles_plugin_megatron.trainer import MegatronTrainer

    assert not hasattr(MegatronTrainer, "response_logprobs") and not issubclass(MegatronTrainer, ExactScoring)
