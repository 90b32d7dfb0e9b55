"""LoRA model spec: only adapters train, only adapters sync after the first sync, merged export."""
import miles
import pytest
import torch
from miles import ConfigError
from miles.config import resolve
from miles.testing import assert_lazy_registration

TINY = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
        "tie_word_embeddings": True}


def lora_spec(**kw):
    from miles_plugin_lora.config import LoraSpecConfig
    from miles_plugin_lora.spec import LoraSpec

    return LoraSpec(LoraSpecConfig(base={"name": "hf", "config": TINY}, **kw))


def tokenizer():
    from miles_plugin_arith.env import char_tokenizer

    return char_tokenizer()


def test_only_adapter_weights_train():
    spec = lora_spec(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    model = spec.build_model(tokenizer())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # q_proj and v_proj of both layers, A and B each
    assert len(trainable) == 2 * 2 * 2
    assert all(spec.sync_filter(n) for n in trainable)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert "model.embed_tokens.weight" in frozen and not any(spec.sync_filter(n) for n in frozen)
    # the Hugging Face forward signature is kept (engines look for logits_to_keep / cache there)
    out = model(input_ids=torch.tensor([[3, 4, 5]]), logits_to_keep=1)
    assert out.logits.shape[1] == 1


def test_a_training_step_changes_adapters_only():
    pm = miles.make_plugin_manager()
    spec, tok = lora_spec(r=4), tokenizer()
    trainer = pm.create("trainers", "fsdp2", pm.registry("trainers")["fsdp2"].config(lr=1e-2),
                        spec=spec, tokenizer=tok, seed=0)
    before = {n: t.clone() for n, t in trainer.named_weights()}
    s = miles.Sample(miles.Task("1+1="), prompt_ids=[3, 12, 3, 13], response_ids=[4, 1])
    batch = miles.Batch.from_samples([s, s], tok.pad_token_id)
    for _ in range(2):  # lora_B starts at zero: the first step moves B, the second also A
        trainer.train_step(batch, lambda b, lp: (-b.token_mean(lp), {}))
    changed = {n for n, t in trainer.named_weights() if not torch.equal(t, before[n])}
    assert changed and all(spec.sync_filter(n) for n in changed)
    assert any(".lora_A." in n for n in changed) and any(".lora_B." in n for n in changed)


def test_export_merges_adapters_into_a_plain_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    spec, tok = lora_spec(r=4, alpha=8), tokenizer()
    model = spec.build_model(tok)
    torch.manual_seed(1)
    with torch.no_grad():  # non-zero adapters, so the merge has something to fold in
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    spec.save_pretrained(model.state_dict().items(), tok, str(tmp_path / "out"))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    ids = torch.tensor([[3, 4, 12, 5, 6, 13]])
    torch.testing.assert_close(plain(input_ids=ids).logits, model.eval()(input_ids=ids).logits,
                               atol=1e-5, rtol=1e-5)


def test_config_errors_name_the_base_keys():
    pm = miles.make_plugin_manager()
    for base, match in (({"name": "nope"}, "model.base.name: unknown model spec 'nope'"),
                        ({"name": "hf", "config": TINY, "colour": 1}, "model.base.colour"),
                        ({"name": "lora"}, "cannot wrap itself")):
        with pytest.raises(ConfigError, match=match):
            resolve(pm, {"model": {"name": "lora", "base": base}})
    with pytest.raises(ConfigError, match="model.r"):
        resolve(pm, {"model": {"name": "lora", "base": {"config": TINY}, "r": 0}})


def test_registration_is_lazy():
    assert_lazy_registration("miles_plugin_lora", "model_specs", "lora")
