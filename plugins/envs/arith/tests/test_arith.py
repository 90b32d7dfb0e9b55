from miles import Sample
from miles_plugin_arith.config import ArithConfig
from miles_plugin_arith.env import ArithEnv


def test_splits_are_disjoint_and_complete():
    env = ArithEnv(ArithConfig(digits=2, eval_size=500))
    train, ev = env.tasks("train"), env.tasks("eval")
    assert len(ev) == 500 and len(train) == 9500
    assert not {t.id for t in train} & {t.id for t in ev}
    t = ev[0]
    a, b = t.metadata["a"], t.metadata["b"]
    assert t.prompt == f"{a:02d}+{b:02d}=" and t.label == f"{a + b:03d}"


def test_exact_match_reward():
    env = ArithEnv(ArithConfig(digits=1, eval_size=10))
    t = env.tasks("eval")[0]
    assert env.reward(Sample(t, response=t.label)) == 1.0
    assert env.reward(Sample(t, response=t.label + "0")) == 0.0


def test_teacher_forgets_the_carry_at_the_configured_rate():
    env = ArithEnv(ArithConfig(digits=2, teacher_carry_accuracy=0.3, demos_per_task=4))
    carry = [(t, r) for t, r in env.demonstrations() if t.metadata["carry"]]
    plain = [(t, r) for t, r in env.demonstrations() if not t.metadata["carry"]]
    assert all(r == t.label for t, r in plain)
    right = sum(r == t.label for t, r in carry) / len(carry)
    assert 0.28 < right < 0.32
    wrong = [(t, r) for t, r in carry if r != t.label]
    assert all(int(r) == t.metadata["a"] + t.metadata["b"] - 10 for t, r in wrong)


def test_char_tokenizer_roundtrip():
    tok = ArithEnv(ArithConfig(digits=1, eval_size=10)).tokenizer()
    ids = tok.encode("07+45=", add_special_tokens=False)
    assert len(ids) == 6 and tok.decode(ids) == "07+45="
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "07+45="


def test_registration_is_lazy():
    from miles.testing import assert_lazy_registration

    assert_lazy_registration("miles_plugin_arith", "envs", "arith")


def test_the_tokenizer_keeps_the_quickstart_ids():
    # the digits, "+" and "=" at 2..13 and no <bos>: a model sized for 14 tokens loads unchanged
    tok = ArithEnv(ArithConfig(digits=1, eval_size=10)).tokenizer()
    assert tok.encode("0123456789+=", add_special_tokens=False) == list(range(2, 14))
    assert (len(tok), tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (14, 0, 1, None)
    assert tok.encode("7?", add_special_tokens=False) == [9, tok.pad_token_id]
