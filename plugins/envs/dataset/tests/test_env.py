"""The env's reward, metrics and answers on samples; the prompt-length filter with a real
tokenizer; the python tool in the sandbox."""
import json

import pytest
from miles import MilesError, Sample
from miles.protocols import EnvMetrics, ExtractsAnswers, OffersTools, UsesTokenizer
from miles.testing import char_tokenizer
from miles_plugin_dataset.config import DatasetConfig
from miles_plugin_dataset.env import DatasetEnv

TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[a]{% endif %}")


@pytest.fixture
def data(tmp_path):
    rows = [{"prompt": "short", "answer": "12"}, {"prompt": "a much longer prompt here", "answer": "7"}] * 5
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make(data, **kw):
    return DatasetEnv(DatasetConfig(train_files=[data], eval_files=[data], shuffle=False, **kw), seed=0)


def test_reward_metrics_and_answers(data):
    env = make(data)
    assert isinstance(env, (EnvMetrics)) and isinstance(env, ExtractsAnswers) and isinstance(env, UsesTokenizer)
    task = env.tasks("train")[0]
    right, wrong, none = (Sample(task=task, response=r) for r in ("so \\boxed{12}", "it is 13", "no idea"))
    assert [env.reward(s) for s in (right, wrong, none)] == [1.0, 0.0, 0.0]
    assert env.answer(right) == "12" and env.answer(none) is None
    assert env.metrics([right, wrong, none, Sample(task=task)]) == {  # an unscored sample is left out
        "math_extract_failed": pytest.approx(1 / 3), "math_label_failed": 0.0}
    # a multi-turn sample is scored on its last turn only
    turns = Sample(task=task, response="calc 5*7 -> 35 then 12", extensions={"multi_turn": {"final_response": "13"}})
    assert env.reward(turns) == 0.0 and env.answer(turns) == "13"


def test_prompts_over_the_token_limit_are_dropped_and_counted(data, capsys):
    env = make(data, max_prompt_tokens=20)  # "[user]short[a]" is 14 characters, the long one 34
    env.use_tokenizer(char_tokenizer("abcdefghijklmnopqrstuvwxyz []", TEMPLATE))
    assert len(env.tasks("train")) == 5 and env.dropped == {"train": 5, "eval": 5}
    assert "dropped 5 of 10 train prompts longer than env.max_prompt_tokens=20" in capsys.readouterr().err
    with pytest.raises(MilesError, match="every train prompt is longer .*shortest has 14 tokens"):
        make(data, max_prompt_tokens=5).use_tokenizer(char_tokenizer("abcdefghijklmnopqrstuvwxyz []", TEMPLATE))
    with pytest.raises(MilesError, match="tokenizer has no chat template; set env.chat_template: false"):
        make(data).use_tokenizer(char_tokenizer("abc"))
    raw = make(data, chat_template=False, max_prompt_tokens=5)
    raw.use_tokenizer(char_tokenizer("abcdefghijklmnopqrstuvwxyz "))
    assert [t.prompt for t in raw.tasks("train")] == ["short"] * 5


def test_python_tool_runs_in_the_sandbox(data):
    env = make(data, tools=["python"])
    assert isinstance(env, OffersTools) and env.tools()[0]["function"]["name"] == "python"
    task = env.tasks("train")[0]
    assert env.call_tool("python", {"code": "print(6 * 7)"}, task) == "42"
    with pytest.raises(ValueError, match="ZeroDivisionError"):
        env.call_tool("python", {"code": "1/0"}, task)
    with pytest.raises(ValueError, match="unknown tool 'python'; tools: none"):
        make(data).call_tool("python", {"code": "print(1)"}, task)


def test_a_malformed_label_names_the_row(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": "write f", "answer": "x", "tests": [1, 2]}) + "\n")
    env = DatasetEnv(DatasetConfig(train_files=[str(path)], eval_files=[str(path)], reward="code"), seed=0)
    with pytest.raises(MilesError, match=r"c.jsonl:1 \(file:row\): code tests must be"):
        env.reward(Sample(task=env.tasks("train")[0], response="def f(): pass"))
