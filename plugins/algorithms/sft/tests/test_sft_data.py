"""SFT from dataset files: reading, chat rendering with assistant-only loss, sequence packing."""
import dataclasses
import json
import random

import miles
import pytest
import torch
from miles import MilesError, Sample, Task
from miles.testing import TinySpec, char_tokenizer
from miles_plugin_sft.algorithm import SFT
from miles_plugin_sft.config import SFTConfig
from miles_plugin_sft.data import chat_example
from miles_plugin_sft.packing import block_causal_mask, first_fit, pack

# a template in the char tokenizer's alphabet: "(user)...<eos>(assistant)...<eos>"
TEMPLATE = ("{% for m in messages %}({{ m['role'] }}){{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}(assistant){% endif %}")


def chat_tokenizer():
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompt_response_rows_from_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "1+2=", "response": "3", "label": "3"}, {"prompt": "4+4=", "response": "8", "label": "8"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    tok = char_tokenizer()
    for path in (write_jsonl(tmp_path / "d.jsonl", rows), str(tmp_path / "d.parquet")):
        algo = SFT(SFTConfig(data=path))
        got = algo.supervised_samples(tok, 50, random.Random(0))
        assert len(got) == 50 and {s.response for s in got} == {"3", "8"}
        s = next(s for s in got if s.response == "3")
        assert s.prompt_ids == tok.encode("1+2=", add_special_tokens=False)
        assert s.response_ids == tok.encode("3", add_special_tokens=False) + [tok.eos_token_id]
        assert s.loss_mask == [1, 1] and s.task.label == "3" and s.reward is None  # the env scores it


def test_without_data_the_loop_uses_env_demonstrations():
    assert SFT(SFTConfig()).supervised_samples(char_tokenizer(), 4, random.Random(0)) is None


def test_chat_rows_train_only_assistant_tokens(tmp_path):
    tok = chat_tokenizer()
    msgs = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3="}, {"role": "assistant", "content": "6"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    s = SFT(SFTConfig(data=path)).supervised_samples(tok, 1, random.Random(0))[0]
    # the prompt is everything up to the first assistant content, generation prompt included
    assert tok.decode(s.prompt_ids) == "(user)2+2=<eos>(assistant)"
    trained = [t for t, m in zip(s.response_ids, s.loss_mask) if m]
    skipped = [t for t, m in zip(s.response_ids, s.loss_mask) if not m]
    # each assistant turn with its end-of-turn token; the second user turn and its header are not
    assert tok.decode(trained) == "4<eos>6<eos>"
    assert tok.decode(skipped) == "(user)3+3=(assistant)".replace("=(", "=<eos>(")
    assert s.reward == 0.0  # no label column: nothing for the verifier to compare


def test_chat_errors_name_the_fix():
    msgs = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
    with pytest.raises(MilesError, match="chat_template"):
        chat_example(char_tokenizer(), msgs)
    with pytest.raises(MilesError, match="no assistant"):
        chat_example(chat_tokenizer(), msgs[:1])
    rewriting = chat_tokenizer()  # drops earlier turns once a later one exists: not prefix-stable
    rewriting.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}a{% endif %}"
    with pytest.raises(MilesError, match="prefix"):
        chat_example(rewriting, msgs)


def test_missing_or_malformed_data_files(tmp_path):
    tok = char_tokenizer()
    with pytest.raises(MilesError, match="export_data"):
        SFT(SFTConfig(data=str(tmp_path / "none.jsonl"))).supervised_samples(tok, 1, random.Random(0))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(MilesError, match="prompt_key"):
        SFT(SFTConfig(data=bad)).supervised_samples(tok, 1, random.Random(0))
    ok = SFT(SFTConfig(data=bad, prompt_key="question", response_key="answer"))
    assert ok.supervised_samples(tok, 1, random.Random(0))[0].response == "2"
    (tmp_path / "d.csv").write_text("prompt,response\n1,2\n")
    with pytest.raises(MilesError, match="must end in"):
        SFT(SFTConfig(data=str(tmp_path / "d.csv"))).supervised_samples(tok, 1, random.Random(0))


def test_config_rejects_packing_with_per_row_means():
    with pytest.raises(ValueError, match="token-mean"):
        SFTConfig(pack=True, loss_agg="seq-mean-token-mean")


# -- packing ------------------------------------------------------------------------------------
def random_samples(n, seed=0, vocab=(3, 40)):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(*vocab) for _ in range(rng.randrange(1, 6))]
        r = [rng.randrange(*vocab) for _ in range(rng.randrange(1, 6))]
        out.append(Sample(Task("t"), prompt_ids=p, response_ids=r, loss_mask=[rng.choice([0, 1, 1]) for _ in r]))
    return out


def make_trainer(tok):
    """The installed fsdp2 trainer (through the registry) over a seeded tiny model."""
    pm = miles.make_plugin_manager()
    return pm.create("trainers", "fsdp2", pm.registry("trainers")["fsdp2"].config(),
                     spec=TinySpec(hidden=32), tokenizer=tok, seed=0)


def test_first_fit_keeps_order_and_capacity():
    assert first_fit([4, 4, 3, 9, 1], 8) == [[0, 1], [2, 4], [3]]


def test_block_causal_mask():
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    m = block_causal_mask(seg)[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                 [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]


def test_packed_layout():
    samples = random_samples(9)
    b = pack(samples, pad_id=0, length=16)
    assert b.input_ids.shape[1] <= 16 and len(b) < 9
    assert sum(s.extensions["sft"]["examples"] for s in b.samples) == 9
    # every trained token of every example, and no other, is in the loss mask
    assert int(b.loss_mask.sum()) == sum(sum(s.loss_mask) for s in samples)
    for r in range(len(b)):  # positions restart at 0 at every example's first token
        assert b.position_ids[r, 0] == 0


def test_packing_has_no_cross_contamination():
    """Packed log-probs equal the examples scored alone, are bitwise unchanged when the other
    examples of the row change, and no gradient flows from one example into another."""
    tok = char_tokenizer()
    trainer = make_trainer(tok)
    samples = random_samples(12)
    packed = pack(samples, 0, 24)
    alone = torch.cat([trainer.logprobs(miles.Batch.from_samples([s], 0))[0][torch.tensor(s.loss_mask) > 0]
                       for s in samples])
    lp = trainer.logprobs(packed)
    torch.testing.assert_close(lp[packed.loss_mask > 0], alone, atol=2e-5, rtol=0)  # same numbers

    # change every token of the row's other examples: the first example's log-probs stay bit-equal
    first = packed.samples[0].extensions["sft"]["examples"]
    assert first > 1
    n0 = len(samples[0].prompt_ids) + len(samples[0].response_ids)
    other = packed.input_ids.clone()
    other[0, n0:] = (other[0, n0:] + 7) % 40 + 3
    changed = trainer.logprobs(dataclasses.replace(packed, input_ids=other))
    assert torch.equal(changed[0, :n0 - 1], lp[0, :n0 - 1])

    # gradient of example 0's loss with respect to the other examples' input embeddings is zero
    model = TinySpec(hidden=32).build_model(tok)
    emb = model.get_input_embeddings()(packed.input_ids[:1]).detach().requires_grad_(True)
    out = model(inputs_embeds=emb, attention_mask=packed.attention_mask[:1],
                position_ids=packed.position_ids[:1]).logits
    out[0, :n0 - 1].sum().backward()
    assert emb.grad[0, n0:].abs().max() == 0 and emb.grad[0, :n0].abs().max() > 0


def test_packed_sft_step_matches_unpacked():
    """One SFT loss on packed rows equals the unpacked loss (token-mean over the same tokens)."""
    trainer = make_trainer(char_tokenizer())
    samples = random_samples(10, seed=3)
    algo = SFT(SFTConfig(pack=True, pack_length=20))
    packed = algo.make_batch(samples, 0)
    plain = SFT(SFTConfig()).make_batch(samples, 0)
    loss_p, _ = algo.loss(packed, trainer.logprobs(packed))
    loss_u, _ = algo.loss(plain, trainer.logprobs(plain))
    assert loss_p.item() == pytest.approx(loss_u.item(), abs=1e-5)
