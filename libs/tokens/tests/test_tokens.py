from miles.testing import char_tokenizer
from miles_tokens import decode_batch, encode_prompts


class Plain:
    """A tokenizer without a fast backend: the per-list path; a chat template that tags roles."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [self.encode(t) for t in texts]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(map(chr, row)) for row in ids]


def test_text_prompts_round_trip_through_a_fast_tokenizer():
    tok = char_tokenizer()
    ids = encode_prompts(tok, ["1+2=", "30-4="])
    assert [len(i) for i in ids] == [4, 5]
    assert decode_batch(tok, ids) == ["1+2=", "30-4="]
    # special tokens: skipped by default, their text kept on request (each on its own and in a row)
    eos = tok.eos_token_id
    assert decode_batch(tok, [[eos], ids[0] + [eos]]) == ["", "1+2="]
    assert decode_batch(tok, [[eos], ids[0] + [eos]], skip_special=False) == ["<eos>", "1+2=<eos>"]


def test_chat_prompts_use_the_chat_template_and_text_stays_plain():
    tok = Plain()
    chat, text = encode_prompts(tok, [[{"role": "user", "content": "hi"}], "x"])
    assert decode_batch(tok, [chat, text]) == ["<user>hi<assistant>", "x"]


def test_pad_samples_lays_out_prompts_left_and_responses_right():
    from miles import Batch, Sample, Task

    t = Task("p")
    short = Sample(task=t, prompt_ids=[7], response_ids=[5], logprobs=[-0.5], reward=1.0)
    long = Sample(task=t, prompt_ids=[8, 9], response_ids=[5, 6, 4], loss_mask=[1, 0, 1], reward=None)
    b = Batch.from_samples([short, long], pad_id=0, advantages=[2.0, [1.0, 2.0, 3.0]])
    assert b.prompt_len == 2 and b.input_ids.tolist() == [[0, 7, 5, 0, 0], [8, 9, 5, 6, 4]]
    assert b.attention_mask.tolist() == [[0, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 0, 1, 1, 1], [0, 1, 2, 3, 4]]
    assert b.loss_mask.tolist() == [[1, 0, 0], [1, 0, 1]]
    assert b.advantages.tolist() == [[2.0, 0.0, 0.0], [1.0, 2.0, 3.0]]
    assert b.rollout_logprobs.tolist() == [[-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert b.rewards.tolist() == [1.0, 0.0] and b.global_tokens == 3.0 and b.global_samples == 2
    assert b.samples == [short, long] and len(b) == 2


def test_routed_experts_rows_lay_records_out_by_row_and_refuse_another_models():
    import pytest
    import torch
    from miles import Sample, Task
    from miles_tokens import routed_experts_rows

    rec = torch.arange(3 * 2 * 2, dtype=torch.int32).view(3, 2, 2) % 4
    t = Task("p")
    samples = [Sample(task=t, prompt_ids=[1], response_ids=[2, 3], extensions={"moe": {"routed_experts": rec}}),
               Sample(task=t, prompt_ids=[1], response_ids=[2]),  # no record: routed as usual
               Sample(task=t, prompt_ids=[1], response_ids=[2],
                      extensions={"moe": {"routed_experts": rec[:2].flatten().tolist()}})]  # flat, as SGLang
    table = routed_experts_rows(samples, "moe", 2, 2, width=5, starts=[0, 0, 2])
    assert table.shape == (3, 5, 2, 2) and table.dtype == torch.long
    assert torch.equal(table[0, :3], rec.long()) and bool((table[0, 3:] == -1).all())
    assert bool((table[1] == -1).all())
    assert bool((table[2, :2] == -1).all()) and torch.equal(table[2, 2:4], rec[:2].long())
    assert torch.equal(routed_experts_rows(samples, "other", 2, 2, width=5), torch.full((3, 5, 2, 2), -1))
    with pytest.raises(ValueError, match=r"sample 0's routed experts have shape \(3, 2, 2\).*\[tokens <= 5, 3, 2\]"):
        routed_experts_rows(samples, "moe", 3, 2, width=5)
    with pytest.raises(ValueError, match=r"sample 2's .*\[tokens <= 1, 2, 2\]"):
        routed_experts_rows(samples, "moe", 2, 2, width=5, starts=[0, 0, 4])
    with pytest.raises(ValueError, match="sample 0 names expert 3; the model has 3 experts"):
        routed_experts_rows(samples, "moe", 2, 2, width=5, experts=3)
