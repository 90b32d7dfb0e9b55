"""DeepSeek-V3's engine attention on a CUDA device: decoding over the cached MLA latent with
``kv_b_proj`` absorbed gives transformers' log-probs in float32, and in bfloat16 stays as close to
a float32 forward as transformers' own bfloat16 forward does."""
import pytest
import torch
from miles import SamplingParams, make_plugin_manager

pytestmark = pytest.mark.gpu

CONFIG = dict(model_type="deepseek_v3", hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False, vocab_size=128,
              intermediate_size=512, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
              num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=64,
              q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, routed_scaling_factor=2.5)


class Tok:
    eos_token_id = None
    pad_token_id = 0

    def __len__(self) -> int:
        return CONFIG["vocab_size"]


def lively(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Random weights far from uniform outputs (the default init makes every distribution flat)."""
    g = torch.Generator().manual_seed(1)
    return [(n, torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            for n, p in model.named_parameters() if p.dim() >= 2]


def logprobs(model, prompt, response):
    with torch.inference_mode():
        ids = torch.tensor([prompt + response], device="cuda")
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logp.gather(-1, torch.tensor(response, device="cuda")[:, None]).squeeze(-1).cpu()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_latent_decode_on_cuda(dtype):
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device")
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    pm = make_plugin_manager()
    spec = pm.create("model_specs", "hf", pm.registry("model_specs")["hf"].config(config=CONFIG), pm=pm)
    engine = TorchEngine(TorchEngineConfig(impl="hf", device="cuda", dtype=dtype), spec=spec, tokenizer=Tok(), seed=0)
    weights = lively(engine.model)
    engine.load_weights(weights, version=1)
    attn = engine.model.model.layers[0].self_attn
    assert attn.forward.__func__ is not type(attn).forward  # the absorbed decode is installed
    plain = {}  # transformers' own attention, float32 and the engine's dtype
    for name, dt in (("float32", torch.float32), (dtype, getattr(torch, dtype))):
        plain[name] = spec.build_model(Tok()).to("cuda", dt).eval()
        plain[name].load_state_dict(dict(weights), strict=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (200, 37, 120, 5)]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=0), n=2)
    engine_err, plain_err = [], []
    for prompt, comps in zip(prompts, outs):
        for comp in comps:
            assert len(comp.token_ids) == 64
            exact = logprobs(plain["float32"], prompt, comp.token_ids)
            engine_err.append((torch.tensor(comp.logprobs) - exact).abs())
            plain_err.append((logprobs(plain[dtype], prompt, comp.token_ids) - exact).abs())
    engine_err, plain_err = torch.cat(engine_err), torch.cat(plain_err)
    if dtype == "float32":
        assert engine_err.max() < 1e-4, engine_err.max()
    else:
        assert engine_err.mean() < 2 * plain_err.mean() + 1e-3, (engine_err.mean(), plain_err.mean())
