import pytest
import torch

from miles import Batch, Sample, Task
from miles.testing import char_tokenizer
from miles_plugin_fsdp2 import fast
from miles_plugin_fsdp2.trainer import _full_logits, _runs, _shared_prompt_logits
from miles_fastpath import cpu_gemm

GEMMS = ["mkl"] + ["onednn"] * cpu_gemm.onednn_available()  # oneDNN where this torch build has it


def _model(kind="qwen2", **kw):
    import transformers

    tok = char_tokenizer()
    cfg = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               pad_token_id=tok.pad_token_id, **kw)
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).train()
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).train()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)).train()


def _batch(groups=(3, 1, 2), same_prompt_len=False):
    g = torch.Generator().manual_seed(3)
    samples = []
    for k, n in enumerate(groups):  # prompts of several lengths: left padding in the batch
        p = torch.randint(3, 20, (4 if same_prompt_len else 2 + k,), generator=g).tolist()
        for i in range(n):  # responses of several lengths: right padding
            r = torch.randint(3, 20, (1 + (i + 2 * k) % 5,), generator=g).tolist()
            samples.append(Sample(Task("x"), prompt_ids=p, response_ids=r))
    return Batch.from_samples(samples, pad_id=0, advantages=[1.0] * len(samples))


def _logprobs(logits, b):
    return torch.log_softmax(logits.float(), -1).gather(-1, b.input_ids[:, b.prompt_len:, None])[..., 0]


def _check(model, b, runs, gemm, atol=2e-5):
    want = _logprobs(_full_logits(model, b), b)  # padding positions included
    got = _logprobs(fast.response_logits(model, b, runs, gemm), b)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    params = list(model.parameters())
    g1 = torch.autograd.grad(got.sum(), params, allow_unused=True)
    g2 = torch.autograd.grad(want.sum(), params, allow_unused=True)
    for a, c in zip(g1, g2):
        assert (a is None) == (c is None)
        if a is not None:
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("tabled", [True, False])
def test_equals_the_hf_forward_with_padding_and_gradients(shared, tabled, gemm, monkeypatch):
    """Log-probs and every parameter's gradient (the embedding's padding row included, which gets
    none) as the HF forward's, with layer 0's q|k|v from the per-token-id table or computed, and
    the GEMMs in MKL or oneDNN."""
    monkeypatch.setattr(fast, "TABLE_SHARE", 1e9 if tabled else 0.0)
    calls = []
    real = fast._tabled_qkv
    monkeypatch.setattr(fast, "_tabled_qkv", lambda *a: calls.append(1) or real(*a))
    m, b = _model(), _batch()
    assert fast.usable(m, b) and b.input_ids.eq(m.config.pad_token_id).any()
    _check(m, b, _runs(b) if shared else [1] * len(b), gemm)
    assert bool(calls) == tabled


@pytest.mark.parametrize("gemm", GEMMS)
def test_uniform_groups_and_a_one_token_response(gemm):
    m = _model()
    _check(m, _batch(groups=(2, 2, 2), same_prompt_len=True), [2, 2, 2], gemm)
    one = _batch(groups=(2,))
    one = Batch.from_samples([Sample(Task("x"), prompt_ids=s.prompt_ids, response_ids=s.response_ids[:1])
                              for s in one.samples], pad_id=0)
    _check(m, one, [2], gemm)


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("tabled", [True, False])
def test_llama_with_biases(tabled, gemm, monkeypatch):
    monkeypatch.setattr(fast, "TABLE_SHARE", 1e9 if tabled else 0.0)
    m = _model("llama", attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1 and "norm" not in str(p.shape):
                p.normal_()  # biases start at zero: make them count
    b = _batch()
    assert fast.usable(m, b)
    _check(m, b, _runs(b), gemm)


def test_equal_to_the_shared_prompt_hf_path_up_to_rounding(monkeypatch):
    """The same ops in the same order as HF's shared-prompt path. Bit for bit where the GEMM
    library rounds a row the same whatever the number of rows in the call (MKL on an AVX2 host);
    on AVX-512 MKL picks kernels by row count, and this path's one flat GEMM over all tokens then
    differs by about an ulp from HF's per-call ones."""
    m, b = _model(), _batch(groups=(4, 4), same_prompt_len=True)
    monkeypatch.setattr(fast, "TABLE_SHARE", 0.0)  # the table is another op order
    with torch.no_grad():  # padding positions included
        got, want = fast.response_logits(m, b, [4, 4]), _shared_prompt_logits(m, b, [4, 4])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_refuses_what_it_does_not_compute():
    assert "Qwen3" in fast.unsupported_reason(_model("qwen3"))
    b = _batch()
    packed = Batch(**{**b.__dict__, "attention_mask": torch.ones(len(b), 1, 4, 4)})
    assert not fast.usable(_model(), packed)
    m = _model()
    m.model.layers[1].mlp.up_proj = torch.nn.Sequential(m.model.layers[1].mlp.up_proj)
    assert "not nn.Linear" in fast.unsupported_reason(m)


def test_refuses_linear_attention_layers_without_failing():
    """Qwen3-Next's gated DeltaNet layers have no ``self_attn``: the check names a reason instead of raising."""
    import transformers

    cfg = transformers.Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=16, linear_num_key_heads=2,
                                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                       layer_types=["linear_attention", "full_attention"])
    assert fast.unsupported_reason(transformers.Qwen3NextForCausalLM(cfg)) is not None
