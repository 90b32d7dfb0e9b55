"""Multi-token-prediction layers of DeepSeek-V3, GLM-4.5, GLM-5 and Qwen3-Next checkpoints (``CarriesMTP``):
the hf spec keeps them beside the transformers model under the checkpoint's own names
(transformers alone drops them), reads them back from a folder, the fsdp2 trainer's checkpoints and
weight export carry them and train them online, and each layer predicts token i+2 causally from
hidden state i and token i+1."""
from __future__ import annotations

import pytest
import torch
from miles.protocols import CarriesMTP
from miles.testing import char_tokenizer

CONFIGS = {
    "deepseek_v3": {"model_type": "deepseek_v3", "hidden_size": 32, "intermediate_size": 64,
                    "moe_intermediate_size": 16, "num_hidden_layers": 2, "first_k_dense_replace": 1,
                    "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4, "n_group": 1,
                    "topk_group": 1, "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "num_nextn_predict_layers": 1,
                    "max_position_embeddings": 32},
    "glm4_moe": {"model_type": "glm4_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
                 "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                 "num_nextn_predict_layers": 1, "max_position_embeddings": 32},
    # a gated DeltaNet layer, then gated full attention; the MTP layer: full attention over the experts
    "qwen3_next": {"model_type": "qwen3_next", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_conv_kernel_dim": 4,
                   "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                   "num_experts": 4, "num_experts_per_tok": 2, "layer_types": ["linear_attention", "full_attention"],
                   "mtp_num_hidden_layers": 1, "max_position_embeddings": 32},
}
CONFIGS["qwen3_5_moe_text"] = {**CONFIGS["qwen3_next"], "model_type": "qwen3_5_moe_text"}
# GLM-5: DeepSeek-V3's layout plus the sparse attention's indexer (the MTP layer has its own)
CONFIGS["glm_moe_dsa"] = {**CONFIGS["deepseek_v3"], "model_type": "glm_moe_dsa", "index_topk": 4, "index_n_heads": 2,
                          "index_head_dim": 16}
MTP = "model.layers.2."  # num_hidden_layers: the checkpoint's own name of the first MTP layer
# each family's checkpoint names: the MTP module's prefix, its input projection and some of its tensors
NAMES = {
    "deepseek_v3": (MTP, "eh_proj.weight", ("enorm.weight", "hnorm.weight", "shared_head.head.weight",
                                            "embed_tokens.weight", "self_attn.o_proj.weight", "mlp.gate.weight")),
    "glm4_moe": (MTP, "eh_proj.weight", ("enorm.weight", "hnorm.weight", "shared_head.head.weight",
                                         "embed_tokens.weight", "self_attn.o_proj.weight", "mlp.gate.weight")),
    "qwen3_next": ("mtp.", "fc.weight", ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
                                         "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate.weight",
                                         "layers.0.mlp.shared_expert_gate.weight")),
}
NAMES["qwen3_5_moe_text"] = NAMES["qwen3_next"]
NAMES["glm_moe_dsa"] = (MTP, "eh_proj.weight", ("enorm.weight", "shared_head.head.weight", "mlp.gate.weight",
                                                "self_attn.indexer.wq_b.weight", "self_attn.indexer.k_norm.weight"))


def spec(**kw):
    from miles_plugin_hf.config import HFModelConfig
    from miles_plugin_hf.spec import HFModelSpec

    return HFModelSpec(HFModelConfig(**kw))


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.mark.parametrize("family", CONFIGS)
def test_mtp_layers_kept_saved_and_read_back(family, tok, tmp_path):
    from miles_mtp import mtp_layers
    from transformers import AutoModelForCausalLM

    prefix, proj, parts = NAMES[family]
    inline = spec(config=CONFIGS[family])
    assert isinstance(inline.architecture(), CarriesMTP)
    torch.manual_seed(0)
    model = inline.build_model(tok).eval()
    names = [k for k in model.state_dict() if k.startswith(prefix)]
    for part in (proj, *parts):
        assert prefix + part in names
    with torch.no_grad():  # norms start at 0 or 1: make every tensor its own
        for k in names:
            model.state_dict()[k].add_(torch.rand_like(model.state_dict()[k]))
    inline.save_pretrained(model.state_dict().items(), tok, str(tmp_path / "m"))
    # transformers alone drops them ...
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"))
    assert not any(k.startswith(prefix) for k in plain.state_dict())
    # ... the spec reads them back, and the main model computes as before
    back = spec(path=str(tmp_path / "m")).build_model(tok).eval()
    state = back.state_dict()
    for k in names:
        assert torch.equal(state[k], model.state_dict()[k]), k
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(back(ids).logits, plain(ids).logits)
    with torch.no_grad():  # the read-back layer predicts as the saved one (the shared embedding and head too)
        hidden = back.model(ids).last_hidden_state
        want = mtp_layers(model)[0].predict(hidden, ids, model.model.rotary_emb)[1]
        assert torch.equal(mtp_layers(back)[0].predict(hidden, ids, back.model.rotary_emb)[1], want)


@pytest.mark.parametrize("family", CONFIGS)
def test_mtp_predicts_token_i_plus_2_causally(family, tok):
    from miles_mtp import mtp_layers

    torch.manual_seed(0)
    model = spec(config=CONFIGS[family]).build_model(tok).eval()
    (layer,) = mtp_layers(model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        hidden = model.model(ids[:, :-1]).last_hidden_state
        _, logits = layer.predict(hidden, ids[:, 1:], model.model.rotary_emb)
        other = ids[:, 1:].clone()
        other[0, 3] = 11
        _, changed = layer.predict(hidden, other, model.model.rotary_emb)
    assert logits.shape == (1, 5, model.config.vocab_size)
    # positions before the change see none of it (to rounding: grouped expert GEMMs sum in an order
    # that depends on which tokens the batch routes where)
    assert torch.allclose(logits[:, :3], changed[:, :3], rtol=0, atol=1e-6)
    assert (logits[:, 3:] - changed[:, 3:]).abs().max() > 1e-4
    if family == "glm_moe_dsa":  # the engine does not draft over the indexer's key cache: refused, saying so
        from miles_plugin_torch_engine.hf_speculative import _rollback_problem

        assert "DynamicIndexedLayer" in _rollback_problem(model)
        return
    # step: the same entries two at a time over the layer's KV cache (the engine's draft chain)
    from miles_mtp import attention_mask
    from transformers.cache_utils import DynamicCache

    cache, valid, chunks = DynamicCache(), torch.ones((1, 5)), []
    with torch.no_grad():
        for a in range(0, 5, 2):
            b = min(a + 2, 5)
            pos = torch.arange(a, b)[None]
            chunks.append(layer.step(hidden[:, a:b], ids[:, a + 1:b + 1], model.model.rotary_emb, pos,
                                     attention_mask(valid[:, :b], b - a, hidden.dtype), cache)[1])
    assert torch.allclose(torch.cat(chunks, 1), logits, atol=1e-5)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_fsdp2_checkpoint_and_export_keep_mtp_layers(family, tok, tmp_path):
    from miles_plugin_fsdp2.config import FSDP2Config
    from miles_plugin_fsdp2.trainer import FSDP2Trainer

    prefix, proj, _ = NAMES[family]
    s = spec(config=CONFIGS[family])
    torch.manual_seed(0)
    trainer = FSDP2Trainer(FSDP2Config(lr=1e-2, warmup_steps=0), spec=s, tokenizer=tok, seed=0, total_steps=4)
    weights = {k: v.clone() for k, v in trainer.named_weights()}
    before = {k: v for k, v in weights.items() if k.startswith(prefix)}
    assert prefix + proj in before
    with torch.no_grad():  # stand-in for trained MTP weights
        trainer.load_weights([(k, v + 1 if k in before else v) for k, v in weights.items()])
    trainer.save(str(tmp_path / "ckpt"))
    fresh = FSDP2Trainer(FSDP2Config(lr=1e-2, warmup_steps=0), spec=s, tokenizer=tok, seed=1, total_steps=4)
    fresh.load(str(tmp_path / "ckpt"))
    after = dict(fresh.named_weights())
    for k, v in before.items():
        assert torch.equal(after[k], v + 1), k
    s.save_pretrained(after.items(), tok, str(tmp_path / "export"))
    back = spec(path=str(tmp_path / "export")).build_model(tok).state_dict()
    for k, v in before.items():
        assert torch.equal(back[k], v + 1), k


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next", "glm_moe_dsa"])
def test_fsdp2_trains_the_mtp_layer_online_and_leaves_the_policy_alone(family, tok):
    """With a top-level draft: section the fsdp2 trainer steps the MTP layer after each update on
    the step's sequences (cross-entropy of token i+2 from hidden state i and token i+1): its loss
    falls, the policy's weights move only by the policy's own update."""
    from miles import Batch, Sample, Task
    from miles_mtp.train import MTPTraining
    from miles_plugin_fsdp2.config import FSDP2Config
    from miles_plugin_fsdp2.dist import decoder_layers
    from miles_plugin_fsdp2.trainer import FSDP2Trainer

    MTP, proj, _ = NAMES[family]  # noqa: N806 - the module-level name, per family
    torch.manual_seed(0)
    trainer = FSDP2Trainer(FSDP2Config(lr=1e-6, warmup_steps=0), spec=spec(config=CONFIGS[family]),
                           tokenizer=tok, seed=0, total_steps=40, draft={"lr": 1e-2})
    assert isinstance(trainer.draft, MTPTraining)
    # sharded, the MTP layer is a unit of its own: its forward (outside the model's) gathers its weights
    assert trainer.draft.layer in decoder_layers(trainer.model)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(16):  # a pattern two tokens ahead is predictable: x, x+1, x+2, ...
        start = int(torch.randint(5, 15, (1,), generator=g))
        seq = [start + i for i in range(10)]
        samples.append(Sample(task=Task(prompt=""), prompt_ids=seq[:3], response_ids=seq[3:], loss_mask=[1] * 7))
    batch = Batch.from_samples(samples, 0)
    if family == "qwen3_next":  # its MTP layer learns through the policy's frozen head, which a random
        with torch.no_grad():   # init (std 0.02) leaves near uniform: a trained head's scale
            trainer.model.lm_head.weight.mul_(20.0)
    policy = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not n.startswith(MTP)}
    mtp = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n.startswith(MTP)}
    first = trainer.train_step(batch, lambda b, lp: (b.token_mean(-lp) * 0, {}))  # the policy gets no step
    for _ in range(30):
        last = trainer.draft.step(trainer.model, batch)
    assert last["mtp_loss"] < 0.5 * first["mtp_loss"] and last["mtp_top1"] > first["mtp_top1"]
    for n, p in trainer.model.named_parameters():
        # no gradient reaches the policy (Qwen3-Next's MTP layer shares its embedding and head)
        assert p.grad is None or not p.grad.any(), n
        if not n.startswith(MTP):
            assert torch.equal(p, policy[n]), n
    assert not torch.equal(dict(trainer.model.named_parameters())[MTP + proj], mtp[MTP + proj])
