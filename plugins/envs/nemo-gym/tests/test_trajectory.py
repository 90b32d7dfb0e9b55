"""The /run answer -> token sequence conversion and the rollout's failure handling, on answers
shaped like NeMo Gym's (the real servers are exercised in test_integration.py)."""
import json
import math
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from miles import MilesError, SamplingParams, Task
from miles.testing import imported_modules
from miles.types import Status
from miles_plugin_nemo_gym.config import NemoGymConfig, NemoGymRolloutConfig
from miles_plugin_nemo_gym.env import NemoGymEnv, load_rows
from miles_plugin_nemo_gym.rollout import NemoGymRollout, request_body
from miles_plugin_nemo_gym.trajectory import MalformedTrajectory, parse_run


def call(prompt, gen, lps, kind="function_call"):
    return {"type": kind, "prompt_token_ids": prompt, "generation_token_ids": gen, "generation_log_probs": lps}


def answer(*items, reward=1.0, incomplete=None):
    return {"reward": reward, "response": {"output": list(items), "incomplete_details": incomplete}}


def test_multi_turn_answer_is_one_sequence_with_env_tokens_masked():
    tool_out = {"type": "function_call_output", "call_id": "c1", "output": "7"}
    final = call([1, 2, 3, 10, 11, 20, 21], [30, 31], [-0.5, -0.6], kind="message")
    final.update(role="assistant", content=[{"type": "output_text", "text": "7"}])
    t = parse_run(answer(call([1, 2, 3], [10, 11], [-0.1, -0.2]), tool_out, final, reward=1.0))
    assert t.prompt_ids == [1, 2, 3]
    assert t.response_ids == [10, 11, 20, 21, 30, 31]
    assert t.loss_mask == [1, 1, 0, 0, 1, 1]
    assert t.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.5, -0.6]
    assert (t.turns, t.reward, t.text, t.truncated) == (2, 1.0, "7", False)


@pytest.mark.parametrize("bad, match", [
    (answer(call([1], [2], [-0.1]), reward="1"), "reward"),
    (answer(call([1], [2], [-0.1]), reward=math.nan), "reward"),
    ({"reward": 0.0, "response": {"output": "x"}}, "response.output"),
    (answer({"type": "message", "content": []}), "generation_token_ids"),
    (answer(call([1], [2, 3], [-0.1])), "generation_log_probs"),
    (answer(call([1], ["x"], [-0.1])), "generation_token_ids"),
    (answer(call([1, 2], [3], [-0.1]), call([1, 9, 3], [4], [-0.2])), "does not extend"),
])
def test_malformed_answers_are_rejected_with_the_reason(bad, match):
    with pytest.raises(MalformedTrajectory, match=match):
        parse_run(bad)


def test_request_body_carries_the_steps_sampling_settings_without_touching_the_row():
    row = {"responses_create_params": {"input": "1+1="}, "expected_answer": "2"}
    body = request_body(row, SamplingParams(temperature=0.0, top_p=0.9, max_new_tokens=5))
    assert body["responses_create_params"] == {"input": "1+1=", "temperature": 0.0, "top_p": 0.9,
                                               "max_output_tokens": 5}
    assert body["expected_answer"] == "2" and row["responses_create_params"] == {"input": "1+1="}


def test_rows_load_and_bad_files_name_the_key(tmp_path):
    tasks = NemoGymEnv(NemoGymConfig()).tasks("eval")
    assert len(tasks) == 100 and tasks[0].prompt[0]["role"] == "user" and tasks[0].label.isdigit()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"responses_create_params": {"input": "x"}}\nnot json\n')
    with pytest.raises(MilesError, match="env.train_file.*line 2"):
        load_rows(str(bad), "env.train_file", "train")
    bad.write_text('{"expected_answer": "1"}\n')
    with pytest.raises(MilesError, match="responses_create_params.input"):
        load_rows(str(bad), "env.train_file", "train")
    with pytest.raises(MilesError, match="not a file"):
        load_rows(str(tmp_path / "missing.jsonl"), "env.eval_file", "eval")


class FakeAgent(BaseHTTPRequestHandler):
    """Answers /run by the row's expected_answer: "ok", "slow", "bad_json", "http_error", "no_tokens"."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = body["expected_answer"]
        if mode == "slow":
            time.sleep(3)
        status, payload = 200, json.dumps(answer(call([1, 2], [3], [-0.3], kind="message"), reward=1.0))
        if mode == "bad_json":
            payload = "{oops"
        elif mode == "http_error":
            status, payload = 500, '"Hit an exception"'
        elif mode == "no_tokens":
            payload = json.dumps(answer({"type": "message"}))
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload.encode())
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on a slow answer
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_agent():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeAgent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class Tok:
    eos_token_id = 1

    def decode(self, ids, skip_special_tokens=True):
        return ",".join(map(str, ids))


class Engine:
    """The run's engine as the rollout reads it (``miles.protocols.LoadsWeights``): its weight version."""

    weight_version = 4

    def load_weights(self, named_tensors, version):
        self.weight_version = version


def roll(url, modes, max_failed_fraction=1.0, timeout_s=1.0):
    env = NemoGymEnv(NemoGymConfig(agent_url=url, timeout_s=timeout_s, connect_timeout_s=1.0))
    tasks = [Task(prompt="p", label=m, metadata={"row": {"responses_create_params": {"input": "p"},
                                                         "expected_answer": m}}) for m in modes]
    rollout = NemoGymRollout(NemoGymRolloutConfig(max_failed_fraction=max_failed_fraction))
    groups = rollout.generate(tasks, 1, engine=Engine(), env=env, tokenizer=Tok(), params=SamplingParams())
    return [g[0] for g in groups], env, rollout


def test_slow_malformed_and_failing_answers_fail_only_their_samples(fake_agent):
    t0 = time.monotonic()
    samples, env, rollout = roll(fake_agent, ["ok", "slow", "bad_json", "http_error", "no_tokens"])
    assert time.monotonic() - t0 < 2.5  # the slow one is cut at timeout_s, not waited for
    ok, *failed = samples
    assert ok.status == Status.COMPLETED and ok.reward == 1.0 and ok.weight_version == 4
    assert (ok.prompt_ids, ok.response_ids, ok.logprobs, ok.loss_mask) == ([1, 2], [3], [-0.3], [1])
    reasons = [s.extensions["nemo-gym"]["error"] for s in failed]
    for s in failed:
        assert s.status == Status.FAILED and s.reward == 0.0 and s.loss_mask == [0] and len(s.logprobs) == 1
    assert "no answer in time" in reasons[0] and "non-JSON" in reasons[1]
    assert "HTTP 500" in reasons[2] and "generation_token_ids" in reasons[3]
    assert rollout.metrics(samples) == {"turns_mean": 0.2, "env_failed": 4.0} and list(env.failures) == reasons


def test_too_many_failures_or_no_agent_is_an_error(fake_agent):
    with pytest.raises(MilesError, match="2 of 3 trajectories .* failed"):
        roll(fake_agent, ["ok", "http_error", "bad_json"], max_failed_fraction=0.5)
    with pytest.raises(MilesError, match="cannot connect to the NeMo Gym agent.*env.agent_url"):
        roll("http://127.0.0.1:9", ["ok", "ok"])


def test_demonstrations_are_the_rows_teacher_answers(tmp_path):
    env = NemoGymEnv(NemoGymConfig())
    demos = env.demonstrations()
    assert len(demos) == len(env.tasks("train")) == 400
    # the teacher adds right, but ends most answers with a stray "=" that the exact match scores 0
    assert all(text in (task.label, task.label + "=") for task, text in demos)
    stray = sum(text.endswith("=") for _, text in demos) / len(demos)
    assert 0.5 < stray < 0.7, stray
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"responses_create_params": {"input": "1+1="}, "expected_answer": "2"}\n')
    with pytest.raises(MilesError, match="env.demo_field"):
        NemoGymEnv(NemoGymConfig(train_file=str(rows))).demonstrations()


def test_the_tiny_policy_needs_no_pytest():
    """A user's install runs the connector without test tools: in a fresh interpreter with pytest
    blocked the tiny policy module imports and builds its tokenizer, and no import in it or in
    miles_tinypolicy, the ones inside functions included (torch, transformers), names pytest or
    miles.testing (the model itself is torch's and transformers': conftest.py writes one)."""
    import miles_tinypolicy
    from miles_plugin_nemo_gym import tiny_policy

    code = ("import sys; sys.modules['pytest'] = None\n"
            "from miles_plugin_nemo_gym import tiny_policy\nfrom miles_tinypolicy import char_tokenizer\n"
            "tok = char_tokenizer(tiny_policy.CHARS, tiny_policy.TEMPLATE)\n"
            "assert 'torch' not in sys.modules and tok.decode(tok('1+2=')['input_ids']) == '1+2='")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    names = imported_modules(tiny_policy) | imported_modules(miles_tinypolicy)
    assert {"miles_tinypolicy", "torch", "transformers"} <= names, names  # the scan sees the lazy imports
    assert not [n for n in names if n.split(".")[0] in ("pytest", "_pytest") or n.startswith("miles.testing")]
