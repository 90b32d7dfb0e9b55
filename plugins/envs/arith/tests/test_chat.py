"""The chat format: questions as chat messages, the same held-out split as the plain format, and a
grader that wants the computed number (restating the question is not an answer)."""
import pytest
from pydantic import ValidationError

from miles import Sample
from miles.protocols import Env, ExtractsAnswers, OffersTokenizer
from miles_plugin_arith import _make
from miles_plugin_arith.config import ArithConfig


@pytest.fixture(scope="module")
def env():
    return _make(ArithConfig(format="chat", digits=2, eval_size=100, system_prompt="Be brief."))


def test_chat_tasks_are_messages_over_the_plain_split(env):
    plain = _make(ArithConfig(digits=2, eval_size=100))
    assert [t.id for t in env.tasks("eval")] == [t.id for t in plain.tasks("eval")]
    t = env.tasks("eval")[0]
    a, b = t.metadata["a"], t.metadata["b"]
    assert t.prompt == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."}]
    assert t.label == str(a + b)
    # the model's own tokenizer renders the messages: the env offers none
    assert isinstance(env, Env) and isinstance(env, ExtractsAnswers) and not isinstance(env, OffersTokenizer)


@pytest.mark.parametrize("response, score", [
    ("59 + 63 = 122", 1.0),
    ("The answer is \\boxed{122}.", 1.0),
    ("59 + 63 = 122\n\nThe answer is \\boxed{", 1.0),  # cut off after the number
    ("59 + 63", 0.0),                                  # the question restated: math-verify would take it
    ("\\boxed{59 + 63}", 0.0),
    ("59 + 63 = 121", 0.0),
    ("The answer is \\boxed{}.", 0.0),
])
def test_the_final_number_is_graded(env, response, score):
    from miles import Task

    t = Task(prompt=[{"role": "user", "content": "What is 59 + 63?"}], label="122", metadata={}, id="59+63")
    s = Sample(t, response=response)
    assert env.reward(s) == score
    assert env.metrics([s]) == {"regex_no_match": float(not any(c.isdigit() for c in response))}
    assert env.answer(s) == ("122" if score else env.answer(s))


def test_other_operations_and_their_labels():
    env = _make(ArithConfig(format="chat", op="-", digits=1, eval_size=10))
    t = env.tasks("train")[0]
    assert t.label == str(t.metadata["a"] - t.metadata["b"]) and " - " in t.prompt[-1]["content"]
    assert len(t.prompt) == 1  # no system_prompt: the chat template's default applies


def test_plain_only_adds_and_chat_has_no_demonstrations_to_export():
    with pytest.raises(ValidationError, match="env.op '\\*' needs env.format: chat"):
        ArithConfig(op="*")
    with pytest.raises(ValidationError, match="the chat format has none"):
        ArithConfig(format="chat", export_dir="/tmp/x")
