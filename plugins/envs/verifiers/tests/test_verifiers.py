"""The verifiers connector against the real worker (verifiers 0.4 in its own virtualenv) and a
real ``miles serve``; failure handling against a worker that is down, slow or malformed."""
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from miles import MilesError, SamplingParams, Task
from miles.types import Status
from miles_plugin_verifiers.config import VerifiersConfig, VerifiersRolloutConfig
from miles_plugin_verifiers.env import VerifiersEnv
from miles_plugin_verifiers.rollout import VerifiersRollout

PLUGIN = Path(__file__).resolve().parents[1]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answer(prompt: str) -> int:
    a, b = prompt.rstrip("=").split("+")
    return int(a) + int(b)


def play(env, tasks, n, params=PARAMS, per_request=64):
    return VerifiersRollout(VerifiersRolloutConfig(episodes_per_request=per_request)).generate(
        tasks, n, engine=None, env=env, tokenizer=env.tokenizer(), params=params)


def test_tasks_are_the_worker_tasksets_rows(worker_url):
    env = VerifiersEnv(VerifiersConfig(worker_url=worker_url, train_size=20, eval_size=5))
    train, ev = env.tasks("train"), env.tasks("eval")
    assert len(train) == 20 and len(ev) == 5
    assert [t.metadata["idx"] for t in train] == list(range(20))
    assert [t.metadata["idx"] for t in ev] == list(range(20, 25))
    assert all(0 <= answer(t.prompt) <= 18 for t in train + ev)
    assert len({t.prompt for t in train}) > 5  # seeded rows, not one repeated problem


def test_episodes_carry_the_policys_tokens_and_the_tasks_reward(worker_url, policy_url):
    env = VerifiersEnv(VerifiersConfig(worker_url=worker_url, policy_url=policy_url, train_size=6, eval_size=1))
    tok = env.tokenizer()
    tasks = env.tasks("train")
    version = int(json.load(urllib.request.urlopen(f"{policy_url}/get_weight_version"))["weight_version"])
    groups = play(env, tasks, 3, per_request=5)  # 18 episodes over 4 requests: the order must hold
    assert [len(g) for g in groups] == [3] * 6
    for g, t in zip(groups, tasks):
        for s in g:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.extensions
            assert s.task is t and s.prompt_ids == tok.encode(t.prompt, add_special_tokens=False)
            assert 1 <= len(s.response_ids) <= 3 and len(s.logprobs) == len(s.response_ids)
            assert all(lp <= 0.0 for lp in s.logprobs) and s.loss_mask == [1] * len(s.response_ids)
            # the task's own @vf.reward scored the text the policy's tokens decode to
            assert s.reward == float(s.response.strip() == str(answer(t.prompt)))
            assert s.extensions["verifiers"]["rewards"] == {"correct": s.reward}
            assert s.weight_version == version  # the server's, whatever an earlier test pushed


def test_greedy_episodes_match_the_policy_server(worker_url, policy_url):
    env = VerifiersEnv(VerifiersConfig(worker_url=worker_url, policy_url=policy_url, train_size=4, eval_size=1))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3)
    tasks = env.tasks("train")
    samples = [g[0] for g in play(env, tasks, 1, params=greedy)]
    model = json.load(urllib.request.urlopen(f"{policy_url}/v1/models"))["data"][0]["id"]
    for t, s in zip(tasks, samples):
        req = urllib.request.Request(f"{policy_url}/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": model, "prompt": t.prompt, "max_tokens": 3,
                                                      "temperature": 0, "logprobs": 0}).encode())
        choice = json.load(urllib.request.urlopen(req))["choices"][0]
        assert s.response_ids == choice["token_ids"]
        assert s.logprobs == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)


def test_a_policy_that_is_down_fails_the_samples_not_the_run(worker_url):
    env = VerifiersEnv(VerifiersConfig(worker_url=worker_url, policy_url=f"http://127.0.0.1:{free_port()}",
                                       train_size=2, eval_size=1, timeout_s=5))
    t0 = time.monotonic()
    samples = [s for g in play(env, env.tasks("train"), 2) for s in g]
    assert time.monotonic() - t0 < 30
    for s in samples:
        assert s.status == Status.FAILED and s.reward == 0.0 and s.loss_mask == [0]
        assert "policy server" in s.extensions["verifiers"]["error"]


@pytest.fixture
def hanging_socket():
    """Accepts connections and never answers (a policy or worker that hangs)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    srv.close()


def test_a_policy_that_hangs_fails_the_samples_in_time(worker_url, hanging_socket):
    env = VerifiersEnv(VerifiersConfig(worker_url=worker_url, policy_url=hanging_socket, train_size=2,
                                       eval_size=1, timeout_s=1))
    t0 = time.monotonic()
    samples = [s for g in play(env, env.tasks("train"), 1) for s in g]
    assert time.monotonic() - t0 < 20
    assert all(s.status == Status.FAILED and "Timeout" in s.extensions["verifiers"]["error"] for s in samples)


def test_a_worker_that_is_down_is_a_clear_error():
    env = VerifiersEnv(VerifiersConfig(worker_url=f"http://127.0.0.1:{free_port()}", connect_timeout_s=2))
    t0 = time.monotonic()
    with pytest.raises(MilesError, match="worker_url"):
        env.tasks("train")
    with pytest.raises(MilesError, match="cannot reach the verifiers worker"):
        play(env, [Task("1+2=", metadata={"idx": 0}, id="t")], 1)
    with pytest.raises(MilesError, match="rollout.name: verifiers"):
        env.reward(None)
    with pytest.raises(MilesError, match="engine: {name: sglang"):  # an in-process engine never gets the weights
        VerifiersRollout(VerifiersRolloutConfig()).generate([], 1, engine=object(), env=env,
                                                            tokenizer=env.tokenizer(), params=PARAMS)
    assert time.monotonic() - t0 < 20


class FakeWorker(BaseHTTPRequestHandler):
    """A worker double for the connector's own failure handling: ``/rollout`` answers per mode."""

    mode = "slow"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.mode == "slow":
            time.sleep(5)
        eps = [{"reward": "high", "prompt_ids": [3], "completion_ids": [4], "logprobs": [-1.0]},
               {"reward": 1.0, "prompt_ids": [3], "completion_ids": [4, 5], "logprobs": [-1.0]},
               {"reward": 1.0, "prompt_ids": [3], "logprobs": []}, "nonsense"]
        out = {"episodes": eps[:len(body["episodes"])]} if self.mode == "malformed" else {"episodes": []}
        data = json.dumps(out).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the connector gave up first
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_worker():
    servers = []

    def start(mode):
        handler = type("Handler", (FakeWorker,), {"mode": mode})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()


def test_a_slow_worker_fails_the_samples_in_time(fake_worker):
    env = VerifiersEnv(VerifiersConfig(worker_url=fake_worker("slow"), timeout_s=0.5, reply_grace_s=0.5))
    t0 = time.monotonic()
    samples = [s for g in play(env, [Task("1+2=", metadata={"idx": 0}, id="t")], 2) for s in g]
    assert time.monotonic() - t0 < 4
    assert [s.status for s in samples] == [Status.FAILED] * 2
    assert "no answer" in samples[0].extensions["verifiers"]["error"]


def test_malformed_episodes_fail_one_by_one(fake_worker):
    env = VerifiersEnv(VerifiersConfig(worker_url=fake_worker("malformed")))
    samples = play(env, [Task("1+2=", metadata={"idx": 0}, id="t")], 4)[0]
    errors = [s.extensions["verifiers"]["error"] for s in samples]
    assert [s.status for s in samples] == [Status.FAILED] * 4
    assert "reward" in errors[0] and "log-probs" in errors[1] and "token ids" in errors[2] and "malformed" in errors[3]
    # a wrong episode count fails the whole request
    env2 = VerifiersEnv(VerifiersConfig(worker_url=fake_worker("empty")))
    assert all(s.status == Status.FAILED for s in play(env2, [Task("1+2=", metadata={"idx": 0}, id="t")], 2)[0])


def test_make_venv_is_cached(vf_python):
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(PLUGIN / "scripts/make_venv.sh")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == vf_python
    assert time.monotonic() - t0 < 10
    v = subprocess.run([vf_python, "-c", "import verifiers; print(verifiers.__version__)"], capture_output=True,
                       text=True, timeout=60)
    assert v.stdout.strip().startswith("0.4"), v.stderr


def test_registration_is_lazy():
    from miles.testing import assert_lazy_registration

    assert_lazy_registration("miles_plugin_verifiers", "envs", "verifiers")
    assert_lazy_registration("miles_plugin_verifiers", "rollouts", "verifiers")


def test_the_policy_tokenizer_needs_no_pytest():
    """A user's install runs the connector without test tools: pytest is blocked in a fresh interpreter."""
    code = ("import sys; sys.modules['pytest'] = None\n"
            "from miles_plugin_verifiers.policy import chat_tokenizer\n"
            "tok = chat_tokenizer('12+=')\n"
            "ids = tok.apply_chat_template([{'role': 'user', 'content': '1+2='}], tokenize=True, return_dict=False)\n"
            "assert tok.decode(ids) == '1+2='")
    subprocess.run([sys.executable, "-c", code], check=True)
