import pytest
from miles import MilesError, Sample
from miles.testing import assert_lazy_registration
from miles_plugin_tool_use import tools as tools_mod
from miles_plugin_tool_use.config import ToolUseConfig
from miles_plugin_tool_use.env import CALL_CLOSE, CALL_OPEN, ToolUseEnv, answer_of
from miles_plugin_tool_use.tools import ToolError, calculator


def _env(**kw):
    return ToolUseEnv(ToolUseConfig(**{"train_size": 300, "eval_size": 50, **kw}))


def test_calculator_is_exact_and_rejects_what_it_cannot_evaluate():
    assert calculator("347*86") == "29842" and calculator(" (2+3)*-4 ") == "-20"
    assert calculator("7/2") == "3.5" and calculator("8/2") == "4" and calculator("2**10") == "1024"
    for bad, msg in (("", "non-empty"), ("1/0", "division by zero"), ("9**9**9", "too large"),
                     ("__import__('os')", "unsupported"), ("2*", "invalid"), ("1" * 201, "too long")):
        with pytest.raises(ToolError, match=msg):
            calculator(bad)


def test_splits_are_disjoint_and_labelled():
    env = _env()
    train, ev = env.tasks("train"), env.tasks("eval")
    assert len(train) == 300 and len(ev) == 50 and not {t.id for t in train} & {t.id for t in ev}
    t = ev[0]
    a, b = t.metadata["a"], t.metadata["b"]
    assert 100 <= a <= 999 and 10 <= b <= 99 and t.prompt == f"{a}*{b}" and t.label == str(a * b)
    with pytest.raises(MilesError, match="train_size"):
        ToolUseEnv(ToolUseConfig(a_digits=1, b_digits=1, train_size=80, eval_size=10))


def test_reward_reads_the_answer_of_the_last_model_turn():
    env = _env()
    t = env.tasks("eval")[0]
    assert env.reward(Sample(t, response=f"={t.label}")) == 1.0
    assert env.reward(Sample(t, response=f"={t.label}0")) == 0.0
    assert env.reward(Sample(t, response=t.label)) == 0.0  # the answer is written =N
    # multi-turn: the tool's output alone is not an answer; the model's last turn is
    s = Sample(t, response=f"<tool_response>{t.label}</tool_response>",
               extensions={"multi_turn": {"final_response": CALL_OPEN + t.prompt + CALL_CLOSE}})
    assert env.reward(s) == 0.0
    s.extensions["multi_turn"]["final_response"] = f"={t.label}"
    assert env.reward(s) == 1.0
    assert answer_of("=12 ") == "12" and answer_of("12") is None


def test_teacher_transcripts_follow_the_configured_rates():
    env = _env(train_size=2000, teacher_tool_rate=0.3, teacher_bad_call_rate=0.3)
    kinds = {"estimate": 0, "good": 0, "typo": 0, "malformed": 0}
    for task, msgs in env.demonstrations():
        a, b = task.metadata["a"], task.metadata["b"]
        assert [m["role"] for m in msgs][-1] == "assistant"
        if len(msgs) == 1:
            assert msgs[0]["content"] == f"={env.estimate(a, b)}"
            assert env.estimate(a, b) != a * b or (a % 100 == 0 and b % 10 == 0)  # only round factors
            kinds["estimate"] += 1
        elif msgs[1]["content"].startswith("error"):
            assert msgs[2]["content"] == f"={env.estimate(a, b)}"
            kinds["malformed"] += 1
        else:
            expr = msgs[0]["content"][len(CALL_OPEN):-len(CALL_CLOSE)]
            assert msgs[1]["content"] == calculator(expr) and msgs[2]["content"] == f"={msgs[1]['content']}"
            kinds["good" if expr == task.prompt else "typo"] += 1
    n = len(env.demonstrations())
    assert n == 4000
    assert abs(kinds["estimate"] / n - 0.7) < 0.03
    assert abs(kinds["good"] / n - 0.21) < 0.03
    assert abs(kinds["typo"] / n - 0.045) < 0.02 and abs(kinds["malformed"] / n - 0.045) < 0.02


def test_tokenizer_makes_a_calculator_call_short_and_decodes_it_back():
    tok = _env().tokenizer()
    text = CALL_OPEN + "347*86" + CALL_CLOSE
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 10 and tok.decode(ids, skip_special_tokens=True) == text
    assert tok.chat_template is None and tok.eos_token_id == 1


def test_tools_calculator_always_python_only_with_the_sandbox(monkeypatch):
    env = _env()
    task = env.tasks("eval")[0]
    assert env.call_tool("calculator", {"expression": task.prompt}, task) == task.label
    with pytest.raises(ToolError, match="unknown tool"):
        env.call_tool("search", {}, task)
    monkeypatch.setattr(tools_mod, "sandbox_available", lambda: False)
    monkeypatch.setattr("miles_plugin_tool_use.env.sandbox_available", lambda: False)
    assert [t["function"]["name"] for t in env.tools()] == ["calculator"]
    with pytest.raises(ToolError, match="unknown tool"):
        env.call_tool("python", {"code": "print(1)"}, task)
    monkeypatch.setattr("miles_plugin_tool_use.env.sandbox_available", lambda: True)
    assert [t["function"]["name"] for t in env.tools()] == ["calculator", "python"]
    assert [t["function"]["name"] for t in _env(python_tool="off").tools()] == ["calculator"]


def test_python_tool_runs_in_the_sandbox():
    env = _env()  # requirements.txt installs miles-sandbox, so the python tool is offered
    task = env.tasks("eval")[0]
    assert env.call_tool("python", {"code": f"print({task.prompt})"}, task) == task.label
    with pytest.raises(ToolError, match="ZeroDivision"):
        env.call_tool("python", {"code": "1/0"}, task)


def test_registers_without_importing_torch():
    assert_lazy_registration("miles_plugin_tool_use", "envs", "tool_use")
