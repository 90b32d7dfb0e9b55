"""The judge reward against a real ``miles serve``: a tiny chat model trained for a few seconds to
grade two answers (``score:9`` / ``score:1``), so score parsing runs on what the engine really
generates; then a dead endpoint and a silent one, which must cost bounded time."""
import time

import pytest
import torch
from miles.testing import char_tokenizer, fit_answers, listening_port, served
from miles_rewards import make_reward

# no spaces anywhere: saved beside a Qwen2 config, the character tokenizer loads back with a
# byte-level pre-tokenizer that drops them
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz[]:;+=.?"
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
JUDGE = {"prompt_template": "q:{prompt};a:{response};ref:{label}", "max_tokens": 16}
GRADES = {("2+2=?", "4", "4"): "right.score:9", ("2+2=?", "5", "4"): "wrong.score:1"}


def train_judge(tok):
    """A 2-layer Qwen2 that answers each GRADES conversation with its grade, then EOS (~5 s)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    rows = []
    for (q, a, ref), grade in GRADES.items():
        user = JUDGE["prompt_template"].replace("{prompt}", q).replace("{response}", a).replace("{label}", ref)
        prompt = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
        p, g = tok.encode(prompt, add_special_tokens=False), tok.encode(grade, add_special_tokens=False)
        rows.append((p + g + [tok.eos_token_id], len(p)))
    return fit_answers(model, rows, tok.pad_token_id)


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("judge")
    tok = char_tokenizer(CHARS, TEMPLATE)
    train_judge(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    with served(folder) as url:
        yield url + "/v1"


def test_scores_parsed_from_the_served_judges_replies(judge_url):
    judge = make_reward("judge", {"base_url": judge_url, **JUDGE})
    right = judge("4", "4", prompt=[{"role": "user", "content": "2+2=?"}])  # chat prompts render as text
    wrong = judge("5", "4", prompt="2+2=?")
    assert right.score == pytest.approx(0.9) and wrong.score == pytest.approx(0.1)
    for r in (right, wrong):
        assert r.metrics["judge_errors"] == r.metrics["judge_parse_failures"] == r.metrics["judge_retries"] == 0
        assert 0 < r.metrics["judge_seconds"] < 30


def test_a_reply_without_a_score_is_a_parse_failure(judge_url):
    judge = make_reward("judge", {"base_url": judge_url, **JUDGE, "score_pattern": r"rating=(\d+)",
                                  "failure_score": 0.25})
    r = judge("4", "4", prompt="2+2=?")  # the reply is 'right.score:9': no 'rating='
    assert r.score == 0.25 and r.metrics["judge_parse_failures"] == 1.0 and r.metrics["judge_errors"] == 0.0


def test_a_dead_endpoint_fails_fast_and_the_breaker_skips_it():
    with listening_port() as port:
        pass  # closed again: connections are refused
    judge = make_reward("judge", {"base_url": f"http://127.0.0.1:{port}/v1", "model": "m", "retries": 1,
                                  "backoff_s": 0.05, "breaker_failures": 2, "breaker_cooldown_s": 60})
    t0 = time.monotonic()
    first, second, third = (judge("x", "y", prompt="q") for _ in range(3))
    assert time.monotonic() - t0 < 10
    assert first.score == 0.0 and first.metrics["judge_errors"] == 1.0 and first.metrics["judge_retries"] == 1.0
    assert second.metrics["judge_errors"] == 1.0
    assert third.metrics["judge_skipped"] == 1.0 and third.metrics["judge_errors"] == 0.0


def test_a_silent_endpoint_costs_at_most_the_timeouts():
    with listening_port() as port:  # accepts connections, never answers
        judge = make_reward("judge", {"base_url": f"http://127.0.0.1:{port}/v1", "model": "m", "timeout_s": 0.5,
                                      "retries": 1, "backoff_s": 0.0})
        t0 = time.monotonic()
        r = judge("x", "y", prompt="q")
        took = time.monotonic() - t0
    assert r.metrics["judge_errors"] == 1.0 and r.metrics["judge_retries"] == 1.0
    assert 0.9 < took < 5, took
