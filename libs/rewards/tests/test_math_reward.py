"""The math reward on real math-verify extraction and symbolic comparison."""
import threading

import pytest
from miles_rewards import make_reward


@pytest.fixture(scope="module")
def math():
    return make_reward("math")


@pytest.mark.parametrize("response,label", [
    ("So the probability is $\\boxed{\\frac{1}{2}}$.", "0.5"),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72"),  # GSM8K
    ("The total is 1,234 dollars.", "1234"),
    ("We get $x = \\frac{\\sqrt{2}}{2}$, so the answer is \\boxed{\\frac{\\sqrt 2}{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("First 3, then 5, so in total 8", "8"),                       # the last number
    ("\\boxed{14} (checking: 12 + 2 = 14, not 15)", "14"),         # boxed beats later numbers
    ("The roots are $\\boxed{\\{1, 2\\}}$", "\\{2, 1\\}"),
    ("It is $2\\pi$", "$\\pi \\cdot 2$"),
    ("#### 7\nI double-checked against 12.", "7"),
])
def test_equivalent_answers_score_one(math, response, label):
    r = math(response, label)
    assert r.score == 1.0, (response, label, r)
    assert r.metrics == {"math_extract_failed": 0.0, "math_label_failed": 0.0}


@pytest.mark.parametrize("response,label", [
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("The total is 1,235.", "1234"),
    ("so 5 + 2 = 7\n#### 8", "7"),
])
def test_wrong_answers_score_zero(math, response, label):
    assert math(response, label).score == 0.0


@pytest.mark.parametrize("response", ["The sum is 59 + 63 = ", "\\boxed{59 + 63}", "$61 \\cdot 2$",
                                      "\\boxed{11^2 + 1}"])
def test_arithmetic_left_to_do_is_no_number(math, response):
    """math-verify evaluates '59 + 63' to 122: copying the question must not score against a number."""
    assert math(response, "122").score == 0.0
    assert make_reward("math", {"numbers_only": False})(response, "122").score == 1.0
    assert math("so the answer is \\boxed{122}", "122").score == 1.0
    assert math("\\boxed{-\\frac{3}{4}}", "-0.75").score == 1.0


def test_failures_are_reported_as_metrics(math):
    none = math("I cannot solve this.", "3")
    assert none.score == 0.0 and none.metrics["math_extract_failed"] == 1.0
    bad_label = math("42", "")
    assert bad_label.score == 0.0 and bad_label.metrics["math_label_failed"] == 1.0
    assert math("42", 42).score == 1.0  # numeric labels straight from a dataset column


def test_works_off_the_main_thread(math):
    # math-verify's own time limit is a SIGALRM, which only the main thread may set
    out = []
    t = threading.Thread(target=lambda: out.append(math("\\boxed{\\frac{2}{4}}", "1/2")))
    t.start()
    t.join(60)
    assert out and out[0].score == 1.0


def test_answers_are_canonical_for_majority_voting(math):
    assert math("\\boxed{\\frac{1}{2}}", "1").answer == math("so 0.5", "1").answer == "0.5"
    assert math("I cannot solve this.", "1").answer is None
