"""The env's demonstrations as SFT samples (the sft algorithm without a dataset, and the warm start):
text answers tokenized with EOS, multi-turn transcripts laid out by the rollout, clear errors."""
import random

import pytest
from miles import MilesError, Task
from miles.testing import char_tokenizer
from miles_plugin_sft.algorithm import SFT
from miles_plugin_sft.config import SFTConfig
from miles_plugin_sft.demos import demo_samples


class Demos:
    def __init__(self, pairs):
        self.pairs = pairs

    def tasks(self, split):
        return [t for t, _ in self.pairs]

    def reward(self, sample):
        return 0.0

    def demonstrations(self):
        return self.pairs


class Transcripts:
    """A rollout that lays out (task, messages): the assistant turns joined."""

    def demonstration(self, task, messages, *, tokenizer, env=None, version=0):
        from miles import Sample

        text = "".join(m["content"] for m in messages if m["role"] == "assistant")
        return Sample(task=task, response=text, weight_version=version)


def test_text_demonstrations_become_prompt_and_answer_tokens_with_eos():
    tok = char_tokenizer()
    env = Demos([(Task("1+2="), "3"), (Task("4+5="), "9")])
    got = SFT(SFTConfig()).supervised_samples(tok, 6, random.Random(0), 7, env=env, rollout=None)
    assert len(got) == 6 and {s.response for s in got} <= {"3", "9"}
    for s in got:
        assert s.prompt_ids == tok.encode(s.task.prompt, add_special_tokens=False)
        assert s.response_ids == tok.encode(s.response, add_special_tokens=False) + [tok.eos_token_id]
        assert s.weight_version == 7 and s.loss_mask == [1] * len(s.response_ids)


def test_transcripts_need_a_rollout_that_lays_them_out():
    tok, env = char_tokenizer(), Demos([(Task("q"), [{"role": "assistant", "content": "a"},
                                                     {"role": "tool", "content": "t"}])])
    got = demo_samples(env.pairs, 2, random.Random(0), tokenizer=tok, env=env, rollout=Transcripts(), version=3)
    assert [(s.response, s.weight_version) for s in got] == [("a", 3), ("a", 3)]
    with pytest.raises(MilesError, match="rollout.name 'single_turn' cannot lay out"):
        demo_samples(env.pairs, 1, random.Random(0), tokenizer=tok, env=env, rollout=object(), version=0,
                     rollout_name="single_turn")


def test_an_env_without_demonstrations_is_an_error_naming_the_fix():
    with pytest.raises(MilesError, match="algorithm sft needs demonstrations.*algorithm.data"):
        SFT(SFTConfig()).supervised_samples(char_tokenizer(), 1, random.Random(0), env=object())
