"""exact, choice and regex on realistic responses; settings errors name the key."""
import pytest
from miles_rewards import RewardConfigError, RewardResult, make_reward, mean_metrics, validate_settings


def test_exact_normalises_case_space_and_punctuation():
    r = make_reward("exact")
    assert r("  The   Eiffel Tower. ", "the eiffel tower").score == 1.0
    assert r("Paris", ["London", "paris"]).score == 1.0
    assert r("Lyon", "Paris").score == 0.0
    empty = r("   ", "Paris")
    assert empty.score == 0.0 and empty.metrics == {"exact_empty": 1.0}
    strict = make_reward("exact", {"case_sensitive": True})
    assert strict("paris", "Paris").score == 0.0 and strict("Paris", "Paris").score == 1.0


@pytest.mark.parametrize("response,label,want", [
    ("The answer is (C).", "C", 1.0),
    ("Let me think. A is wrong, B is wrong. Answer: D", "D", 1.0),
    ("**Answer:** B", "B", 1.0),
    ("B) because the others are false", 1, 1.0),      # an index label: 1 -> B
    ("$\\boxed{A}$", "A", 1.0),
    ("(A)", "B", 0.0),
    ("First I thought A, but the answer is B", "A", 0.0),
])
def test_choice_reads_the_named_letter(response, label, want):
    r = make_reward("choice")
    got = r(response, label)
    assert got.score == want and got.metrics == {"choice_extract_failed": 0.0}


def test_choice_without_a_letter_is_an_extraction_failure_and_a_bad_label_is_an_error():
    r = make_reward("choice", {"letters": "ABCD"})
    assert r("I am not sure", "A").metrics == {"choice_extract_failed": 1.0}
    assert r("The answer is a bit unclear.", "A").metrics == {"choice_extract_failed": 1.0}
    assert r("Answer: E", "A").metrics == {"choice_extract_failed": 1.0}  # E is not an option
    with pytest.raises(RewardConfigError, match="not one of the letters ABCD"):
        r("A", "Z")


def test_regex_answer_and_format_reward():
    r = make_reward("regex", {"pattern": r"<answer>\s*(.*?)\s*</answer>",
                              "format_pattern": r"<think>.*</think>\s*<answer>.*</answer>", "format_weight": 0.25})
    both = r("<think>6*7</think>\n<answer> 42 </answer>", "42")
    assert both.score == 1.0 and both.metrics == {"regex_no_match": 0.0, "regex_format_ok": 1.0}
    assert r("<answer>42</answer>", "42").score == 0.75          # right answer, no <think>
    assert r("<think>x</think><answer>41</answer>", "42").score == 0.25  # format only
    miss = r("forty-two", "42")
    assert miss.score == 0.0 and miss.metrics["regex_no_match"] == 1.0
    # no label: the pattern matching is the reward
    assert make_reward("regex", {"pattern": r"^\d+$"})("123", None).score == 1.0


def test_settings_errors_name_the_key():
    with pytest.raises(RewardConfigError, match="reward 'regex' needs pattern"):
        make_reward("regex")
    with pytest.raises(RewardConfigError, match=r"pattern '\(' is not a valid regular expression"):
        make_reward("regex", {"pattern": "("})
    with pytest.raises(RewardConfigError, match=r"timeout_s: .*greater than or equal to 0"):
        validate_settings("math", {"timeout_s": -1})
    with pytest.raises(RewardConfigError, match=r"lettres: Extra inputs .*allowed: letters"):
        validate_settings("choice", {"lettres": "AB"})
    with pytest.raises(RewardConfigError, match="unknown reward 'maths'; built-in rewards: math, exact"):
        make_reward("maths")


def test_mean_metrics_averages_each_key():
    got = mean_metrics([RewardResult(1.0, {"a": 1.0, "b": 0.0}), RewardResult(0.0, {"a": 0.0, "b": 1.0}),
                        RewardResult(0.0, {"a": 1.0})])
    assert got == {"a": 2 / 3, "b": 0.5}
