"""The code reward runs the response's program against the row's tests in the real sandbox."""
import pytest
from miles_rewards import RewardConfigError, make_reward
from miles_rewards.code import extract_code

GOOD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]


@pytest.fixture(scope="module")
def code():
    return make_reward("code", {"timeout_s": 5})


def test_fraction_of_assert_tests_passing(code):
    r = code(GOOD, None, {"tests": TESTS})
    assert r.score == pytest.approx(2 / 3)
    assert r.metrics == {"code_no_block": 0.0, "code_timeouts": 0.0, "code_all_passed": 0.0}
    assert code(GOOD, TESTS[:2]).metrics["code_all_passed"] == 1.0  # the label holds the tests
    assert code(GOOD, '["assert add(1, 2) == 3"]').score == 1.0      # a JSON string column


def test_stdin_stdout_tests(code):
    prog = "n = int(input())\nprint(n * n)"
    r = code(prog, {"inputs": ["3\n", "4\n", "5\n"], "outputs": ["9\n", "16", "26"]})
    assert r.score == pytest.approx(2 / 3) and r.metrics["code_no_block"] == 1.0


def test_broken_hanging_and_hostile_programs_score_low_without_raising(code):
    assert code("```python\ndef add(a, b) return\n```", TESTS).score == 0.0  # syntax error
    assert code("```python\nimport sys\nsys.exit(3)\n```", TESTS).score == 0.0
    # tests that passed before the program hung still count; the timeout is reported
    slow = "```python\ndef add(a, b):\n    if a == -1:\n        while True: pass\n    return a + b\n```"
    r = code(slow, TESTS)
    assert r.score == pytest.approx(1 / 3) and r.metrics["code_timeouts"] == 1.0
    # a program that prints what looks like a pass marker does not pass tests
    forge = "```python\nprint('passed 0'); print(open('marker.txt').read(), 0)\ndef add(a, b): return None\n```"
    assert code(forge, TESTS).score == 0.0
    # no network in the sandbox
    net = ("```python\nimport socket\ndef add(a, b):\n    socket.create_connection(('1.1.1.1', 53), 2)\n"
           "    return a + b\n```")
    assert code(net, TESTS[:1]).score == 0.0


def test_extract_code_prefers_the_last_python_block():
    text = "```\nplain\n```\n```python\nfirst\n```\ntext\n```py\nsecond\n```\n```bash\nls\n```"
    assert extract_code(text) == ("second", True)
    assert extract_code("x = 1") == ("x = 1", False)


def test_malformed_tests_are_an_error_naming_the_formats(code):
    with pytest.raises(RewardConfigError, match="list of assert statements or of {input, output} pairs"):
        code(GOOD, [1, 2])
