"""The frontier families' tiny models: configs transformers builds, lively weights, seeded folders."""
import pytest
import torch

from miles_tinypolicy import char_tokenizer
from miles_tinypolicy.frontier import FAMILIES, frontier_config, lively, write_frontier_policy


def test_an_unknown_family_names_the_known_ones():
    with pytest.raises(KeyError, match="qwen2.*deepseek_v3, deepseek_v4"):
        frontier_config("qwen2")
    assert frontier_config("gpt_oss")["model_type"] == "gpt_oss" and len(FAMILIES) == 7


def test_the_folder_is_seeded_and_deepseek_v4_hashes_each_token_to_distinct_experts(tmp_path):
    from transformers import AutoModelForCausalLM

    tok = char_tokenizer("abc")
    a, b = (write_frontier_policy(tmp_path / name, "deepseek_v4", tok, seed=3) for name in ("a", "b"))
    c = write_frontier_policy(tmp_path / "c", "deepseek_v4", tok, seed=4)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert loaded.config.vocab_size == len(tok)
    sa, sb, sc, sl = (dict(m.state_dict()) for m in (a, b, c, loaded))
    assert all(torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sl[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    table = sl["model.layers.0.mlp.gate.tid2eid"]  # saved with the weights: what a served folder routes by
    assert table.shape == (len(tok), 2) and (table[:, 0] != table[:, 1]).all() and table.unique().numel() > 2


def test_lively_weights_are_far_from_the_default_init():
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = frontier_config("glm4_moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), vocab_size=16, **kw))
    ids = torch.tensor([[1, 2, 3, 4]])
    def spread(logits):  # per position, the log-prob range over the 16 tokens
        logp = torch.log_softmax(logits[0], -1)
        return logp.max(-1).values - logp.min(-1).values

    with torch.no_grad():
        flat = spread(model(ids).logits)
        model.load_state_dict(dict(lively(model)), strict=False)
        sharp = spread(model(ids).logits)
    assert flat.max() < 1.5 and sharp.min() > 2.5  # measured: 0.5 at init (seed 0), 3.1 lively
