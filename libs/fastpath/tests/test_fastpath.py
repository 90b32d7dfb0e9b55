"""miles_fastpath: the shared RMSNorm, the worker-pool registry, the layout check, free imports."""
import subprocess
import sys
import threading

import pytest
import torch
from miles_fastpath import threads
from miles_fastpath.llama import llama_layout_problem
from miles_fastpath.ops import rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hf_llama_rmsnorm_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
    x = (torch.randn(5, 7, 48, generator=g) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm), norm(x))


def _intra_op_counts(pool, k):
    """The intra-op thread count seen by each of the pool's ``k`` threads (all busy at once)."""
    start = threading.Barrier(k)

    def probe(_):
        start.wait(timeout=30)
        return threading.current_thread().name, torch.get_num_threads()

    return dict(pool.map(probe, range(k)))


def test_pool_registry_threads_counts_and_keys():
    before = torch.get_num_threads()
    p = threads.pool(3, "test-a", threads=2)
    assert torch.get_num_threads() == before  # the caller's count is left as it was
    seen = _intra_op_counts(p, 3)
    assert len(seen) == 3 and set(seen.values()) == {2}
    assert all(name.startswith("miles-test-a") for name in seen)
    assert threads.pool(3, "test-a", threads=2) is p  # one pool per key per process
    assert threads.pool(3, "test-b", threads=2) is not p  # roles never share
    one = threads.pool(2, "test-a")
    assert one is not p and set(_intra_op_counts(one, 2).values()) == {1}
    with pytest.raises(ValueError, match="k=0"):
        threads.pool(0)


def test_layout_check_refuses_other_architectures():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    assert llama_layout_problem(model, ("LlamaForCausalLM",)) is None
    assert "is not one of Qwen2ForCausalLM" in llama_layout_problem(model, ("Qwen2ForCausalLM",))
    model.model.layers[0].mlp.up_proj = torch.nn.Identity()
    assert "mlp.up_proj is Identity" in llama_layout_problem(model, ("LlamaForCausalLM",))


def test_importing_the_package_and_the_layout_check_does_not_import_torch():
    code = ("import sys, miles_fastpath, miles_fastpath.llama, miles_fastpath.cpu_gemm; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
