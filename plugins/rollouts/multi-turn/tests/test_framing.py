import pytest
from miles import MilesError, Task
from miles.testing import assert_lazy_registration, char_tokenizer
from miles_plugin_multi_turn.config import MultiTurnConfig
from miles_plugin_multi_turn.framing import encode_prompt, tool_frame
from miles_plugin_multi_turn.rollout import MultiTurnRollout

CHARS = "0123456789+-*=()<>/{}[]\":,._ \nabcdefghijklmnopqrstuvwxyz"
# a Qwen-like template: every message ends with the EOS token and a newline
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>\n{% endfor %}"
            "{% if tools %}[tools]{{ tools | length }}{% endif %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture
def chat_tok():
    tok = char_tokenizer(CHARS)
    tok.chat_template = TEMPLATE
    return tok


def test_tool_results_framed_by_the_chat_template_after_the_models_eos(chat_tok):
    ids = tool_frame(chat_tok, ["6", "7"], "<unused>{output}", use_template=True)
    # the model's turn ended at <eos>: the frame starts with the newline the template puts after it
    assert ids == chat_tok.encode("\n[tool]6<eos>\n[tool]7<eos>\n[assistant]", add_special_tokens=False)
    assert chat_tok.eos_token_id in ids


def test_text_frame_without_a_template_or_when_told_never(chat_tok):
    plain = char_tokenizer(CHARS)
    assert tool_frame(plain, ["6"], "<r>{output}</r>", use_template=False) == \
        plain.encode("<r>6</r>", add_special_tokens=False)
    ro = MultiTurnRollout(MultiTurnConfig(chat_template="never"))
    assert not ro._use_template(chat_tok) and MultiTurnRollout()._use_template(chat_tok)
    assert not MultiTurnRollout()._use_template(plain)


def test_chat_prompts_show_the_tools_and_need_a_template(chat_tok):
    msgs = [{"role": "user", "content": "2*3"}]
    tools = [{"type": "function", "function": {"name": "calc"}}]
    assert encode_prompt(chat_tok, msgs, tools, True) == \
        chat_tok.encode("[user]2*3<eos>\n[tools]1[assistant]", add_special_tokens=False)
    assert encode_prompt(chat_tok, "2*3", tools, True) == chat_tok.encode("2*3", add_special_tokens=False)
    with pytest.raises(MilesError, match="chat template"):
        encode_prompt(char_tokenizer(CHARS), msgs, tools, False)


def test_demonstration_with_a_chat_template_masks_the_frame_and_trains_each_eos(chat_tok):
    class Env:
        def tools(self):
            return []

    msgs = [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "6"},
            {"role": "assistant", "content": "=6"}]
    s = MultiTurnRollout().demonstration(Task([{"role": "user", "content": "q"}]), msgs, tokenizer=chat_tok, env=Env())
    assert chat_tok.decode(s.prompt_ids) == "[user]q<eos>\n[assistant]"
    text = [chat_tok.decode([i]) for i in s.response_ids]
    assert "".join(text) == "a<eos>\n[tool]6<eos>\n[assistant]=6<eos>"
    trained = "".join(t for t, m in zip(text, s.loss_mask) if m)
    assert trained == "a<eos>=6<eos>"


def test_registers_without_importing_torch():
    assert_lazy_registration("miles_plugin_multi_turn", "rollouts", "multi_turn")
