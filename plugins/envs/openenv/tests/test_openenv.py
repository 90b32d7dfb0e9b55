"""The openenv env and rollout against real OpenEnv servers (create_app under uvicorn)."""
import math
import random
import subprocess
import sys
import threading
import time

import pytest
from miles_procs import unused_port
from miles import Completion, MilesError, Sample, SamplingParams, Task
from miles.types import Status
from miles_plugin_openenv.config import OpenEnvConfig, OpenEnvRolloutConfig
from miles_plugin_openenv.env import EVAL_SEED0, OpenEnvEnv
from miles_plugin_openenv.game import GuessAction, SumGuessEnvironment
from miles_plugin_openenv.rollout import OpenEnvRollout



PARAMS = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1)


def answer(prompt: str) -> int:
    a, b = prompt.rstrip("=").split("+")
    return int(a) + int(b)


class ScriptedEngine:
    """Turn k of an episode (k = EOS tokens in its prompt) answers ``script(k, sum)`` + EOS, each
    token with its own distinct log-prob, so a copy in the wrong place shows."""

    def __init__(self, tok, script):
        self.tok, self.script, self.weight_version, self._next = tok, script, 3, 0
        self.outputs: list[Completion] = []

    def generate(self, prompts, params, n=1):
        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=True)
            turn = list(p).count(self.tok.eos_token_id)
            ids = self.tok.encode(self.script(turn, answer(text[:text.index("=") + 1])),
                                  add_special_tokens=False) + [self.tok.eos_token_id]
            lps = [-(self._next + i + 1) / 1000 for i in range(len(ids))]
            self._next += len(ids)
            c = Completion(ids, lps, "stop", self.weight_version)
            self.outputs.append(c)
            out.append([c] * n)
        return out

    def load_weights(self, named, version):
        self.weight_version = version


def test_game_follows_its_rules():
    g = SumGuessEnvironment(max_turns=2)
    obs = g.reset(seed=5)
    rng = random.Random(5)
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    assert obs.prompt == f"{a}+{b}=" and not obs.done
    low = g.step(GuessAction(message=str(a + b - 1)) if a + b else GuessAction(message="x"))
    assert low.hint == ("^" if a + b else "?") and not low.done and low.reward == 0.0
    last = g.step(GuessAction(message=str(a + b + 1)))
    assert last.hint == "v" and last.done and last.reward == 0.0
    g.reset(seed=5)
    assert g.step(GuessAction(message=f" {a + b}")).reward == 1.0


def test_the_teacher_forgets_most_carries_and_nothing_else():
    refs = [(SumGuessEnvironment(teacher_carry_accuracy=0.4).reset(seed=s), s) for s in range(2000)]
    plain = [o for o, _ in refs if answer(o.prompt) < 10]
    carry = [o for o, _ in refs if answer(o.prompt) >= 10]
    assert all(o.reference == str(answer(o.prompt)) for o in plain)
    kept = sum(o.reference == str(answer(o.prompt)) for o in carry) / len(carry)
    assert 0.33 < kept < 0.47
    assert all(o.reference in (str(answer(o.prompt)), str(answer(o.prompt) % 10)) for o in carry)


def test_demonstrations_are_the_reset_references(server_url):
    env = OpenEnvEnv(OpenEnvConfig(base_url=server_url, train_seeds=12, eval_seeds=2))
    demos = env.demonstrations()
    assert [t.id for t, _ in demos] == [t.id for t in env.tasks("train")]
    for t, ref in demos:
        assert ref == SumGuessEnvironment().reset(seed=t.metadata["seed"]).reference
    none = OpenEnvEnv(OpenEnvConfig(base_url=server_url, train_seeds=2, eval_seeds=1, reference_field="solution"))
    with pytest.raises(MilesError, match="reference_field"):
        none.demonstrations()


def test_tasks_are_the_servers_reset_prompts(server_url):
    env = OpenEnvEnv(OpenEnvConfig(base_url=server_url, train_seeds=20, eval_seeds=5))
    train, ev = env.tasks("train"), env.tasks("eval")
    assert len(train) == 20 and len(ev) == 5
    assert train[7].prompt == SumGuessEnvironment().reset(seed=7).prompt
    assert ev[0].prompt == SumGuessEnvironment().reset(seed=EVAL_SEED0).prompt
    assert not {t.id for t in train} & {t.id for t in ev}


def test_single_turn_reward_is_the_servers(server_url):
    env = OpenEnvEnv(OpenEnvConfig(base_url=server_url, train_seeds=4, eval_seeds=1))
    t = env.tasks("train")[2]
    assert env.reward(Sample(t, response=str(answer(t.prompt)))) == 1.0
    assert env.reward(Sample(t, response=str(answer(t.prompt) + 1))) == 0.0


def test_multi_step_episode_is_one_token_sequence(server_url):
    env = OpenEnvEnv(OpenEnvConfig(base_url=server_url, train_seeds=6, eval_seeds=1))
    tok = env.tokenizer()
    engine = ScriptedEngine(tok, lambda turn, s: str(s + 1) if turn == 0 else str(s))
    tasks = env.tasks("train")
    groups = OpenEnvRollout(OpenEnvRolloutConfig(max_turns=3)).generate(
        tasks, 2, engine=engine, env=env, tokenizer=tok, params=PARAMS)
    assert [len(g) for g in groups] == [2] * 6
    hint = tok.encode("v", add_special_tokens=False)
    for g, task in zip(groups, tasks):
        for s in g:
            assert s.reward == 1.0 and s.status == Status.COMPLETED
            assert s.extensions["openenv"]["turns"] == 2
            assert s.prompt_ids == tok.encode(task.prompt, add_special_tokens=False)
    # every sample: first completion, the masked hint, second completion, with the engine's own data
    flat = [s for g in groups for s in g]
    assert len(engine.outputs) == 2 * len(flat)  # one engine call per turn, one prompt per episode
    for s, c1, c2 in zip(flat, engine.outputs[:len(flat)], engine.outputs[len(flat):]):
        assert s.response_ids == c1.token_ids + hint + c2.token_ids
        assert s.logprobs == c1.logprobs + [0.0] * len(hint) + c2.logprobs
        assert s.loss_mask == [1] * len(c1.token_ids) + [0] * len(hint) + [1] * len(c2.token_ids)
        assert s.weight_versions == [3, 3]


class RecordingEngine(ScriptedEngine):
    """Adds what an MoE engine with routing replay returns: one record row per token it fed
    (prompt + response - 1), each row holding the row's own position so a stale copy shows."""

    def generate(self, prompts, params, n=1):
        out = super().generate(prompts, params, n)
        for p, cs in zip(prompts, out):
            rows = len(p) + len(cs[0].token_ids) - 1
            cs[0].extras = {"moe": {"routed_experts": [[[i]] for i in range(rows)]}, "tag": len(p)}
        return out


def test_engine_extras_reach_the_sample_from_the_last_turn(server_url):
    env = OpenEnvEnv(OpenEnvConfig(base_url=server_url, train_seeds=3, eval_seeds=1))
    tok = env.tokenizer()
    engine = RecordingEngine(tok, lambda turn, s: str(s + 1) if turn == 0 else str(s))
    groups = OpenEnvRollout(OpenEnvRolloutConfig(max_turns=3)).generate(
        env.tasks("train"), 1, engine=engine, env=env, tokenizer=tok, params=PARAMS)
    for s in (g[0] for g in groups):
        assert s.extensions["openenv"]["turns"] == 2
        rec = s.extensions["moe"]["routed_experts"]
        # the second turn fed the prompt, turn 1 and the hint: its rows span the whole sequence
        assert len(rec) == len(s.prompt_ids) + len(s.response_ids) - 1
        assert rec[-1] == [[len(rec) - 1]]
        last = len(str(answer(s.task.prompt))) + 1  # the right sum and EOS
        assert s.extensions["tag"] == len(s.prompt_ids) + len(s.response_ids) - last


def test_an_episode_that_never_succeeds_ends_at_max_turns(server_url):
    env = OpenEnvEnv(OpenEnvConfig(base_url=server_url, train_seeds=2, eval_seeds=1))
    tok = env.tokenizer()
    engine = ScriptedEngine(tok, lambda turn, s: "-")
    groups = OpenEnvRollout(OpenEnvRolloutConfig(max_turns=5)).generate(
        env.tasks("train"), 1, engine=engine, env=env, tokenizer=tok, params=PARAMS)
    s = groups[0][0]
    # the server ends the episode after its own limit of 3 guesses, before the rollout's 5
    assert s.reward == 0.0 and s.extensions["openenv"]["turns"] == 3
    assert s.response == "-?-?-"


def test_server_down_is_a_clear_error_or_a_failed_sample():
    url = f"http://127.0.0.1:{unused_port()}"
    env = OpenEnvEnv(OpenEnvConfig(base_url=url, connect_timeout_s=2))
    t0 = time.monotonic()
    with pytest.raises(MilesError, match="base_url"):
        env.tasks("train")
    task = Task("1+2=", metadata={"seed": 0}, id="t")
    assert math.isnan(env.reward(Sample(task, response="3")))  # the kernel marks it failed
    with pytest.raises(MilesError, match="server running"):
        OpenEnvRollout(OpenEnvRolloutConfig()).generate([task], 1, engine=None, env=env,
                                                       tokenizer=env.tokenizer(), params=PARAMS)
    assert time.monotonic() - t0 < 30


class SlowGame(SumGuessEnvironment):
    def step(self, action, timeout_s=None, **kw):
        time.sleep(3)
        return super().step(action)


class NoPromptGame(SumGuessEnvironment):
    def reset(self, seed=None, episode_id=None, **kw):
        obs = super().reset(seed=seed)
        obs.prompt = ""
        return obs


@pytest.fixture
def serve_in_thread():
    """Serves a given Environment class with OpenEnv's create_app on a uvicorn thread."""
    import uvicorn
    from openenv.core.env_server.http_server import create_app
    from miles_plugin_openenv.game import GuessObservation

    servers = []

    def start(env_cls):
        port = unused_port()
        app = create_app(env_cls, GuessAction, GuessObservation, max_concurrent_envs=64)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.1)
        return f"http://127.0.0.1:{port}"

    yield start
    for s in servers:
        s.should_exit = True


def test_a_slow_server_fails_the_samples_not_the_run(serve_in_thread):
    env = OpenEnvEnv(OpenEnvConfig(base_url=serve_in_thread(SlowGame), train_seeds=2, eval_seeds=1,
                                   message_timeout_s=0.5))
    tok = env.tokenizer()
    t0 = time.monotonic()
    groups = OpenEnvRollout(OpenEnvRolloutConfig()).generate(
        env.tasks("train"), 2, engine=ScriptedEngine(tok, lambda k, s: str(s)), env=env, tokenizer=tok,
        params=PARAMS)
    assert time.monotonic() - t0 < 10
    for s in (s for g in groups for s in g):
        assert s.status == Status.FAILED and s.reward == 0.0
        assert s.response_ids and set(s.loss_mask) == {0}
        assert "Timeout" in s.extensions["openenv"]["error"]


def test_an_observation_without_the_prompt_field_names_the_key(serve_in_thread):
    env = OpenEnvEnv(OpenEnvConfig(base_url=serve_in_thread(NoPromptGame), train_seeds=1, eval_seeds=1,
                                   prompt_field="question"))
    with pytest.raises(MilesError, match="prompt_field"):
        env.tasks("train")


def test_registration_is_lazy():
    from miles.testing import assert_lazy_registration

    assert_lazy_registration("miles_plugin_openenv", "envs", "openenv")
    assert_lazy_registration("miles_plugin_openenv", "rollouts", "openenv")


def test_the_env_tokenizer_needs_no_pytest():
    """A user's install runs the connector without test tools: pytest is blocked in a fresh interpreter."""
    code = ("import sys; sys.modules['pytest'] = None\n"
            "from miles_plugin_openenv.config import OpenEnvConfig\nfrom miles_plugin_openenv.env import OpenEnvEnv\n"
            "tok = OpenEnvEnv(OpenEnvConfig(chars='12')).tokenizer()\n"
            "assert tok('21', add_special_tokens=False)['input_ids'] == [4, 3]")
    subprocess.run([sys.executable, "-c", code], check=True)
