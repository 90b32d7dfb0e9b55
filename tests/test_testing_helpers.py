"""The helpers plugin authors build their tests on do what they say."""
import miles.testing
from miles import Group
from miles.testing import TinySpec, char_tokenizer, make_group


def test_make_group_and_char_tokenizer():
    g = make_group([0.0, 1.0], response_len=4)
    assert isinstance(g, Group) and g.rewards == [0.0, 1.0]
    assert [len(s.response_ids) for s in g.samples] == [4, 4] and g.samples[0].loss_mask == [1] * 4
    tok = char_tokenizer()
    ids = tok("1+2=3", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and tok.decode(ids) == "1+2=3"


def test_tiny_spec_is_seeded_and_the_kernel_ships_the_helpers():
    plugin_manager = miles.testing.make_plugin_manager()
    tok = char_tokenizer()
    a, b = TinySpec(seed=3).build_model(tok), TinySpec(seed=3).build_model(tok)
    assert all((x == y).all() for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.config.vocab_size == len(tok)
    assert "sync" in plugin_manager.registry("modes")
    assert "single_turn" in plugin_manager.registry("rollouts")
