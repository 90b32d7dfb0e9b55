"""Harbor rollout details -> samples, on details shaped like harbor serve's (the real server and
trials are exercised in test_integration.py)."""
import os
import subprocess
import sys

import pytest
from miles import MilesError, Task
from miles.testing import imported_modules
from miles.types import Status
from miles_plugin_harbor.config import HarborConfig, HarborRolloutConfig
from miles_plugin_harbor.env import HarborEnv, task_folders
from miles_plugin_harbor.rollout import HarborRollout, job_config
from miles_plugin_harbor.trajectory import BadTrial, parse_trial


def detail(rewards=None, details=None, error_type=None, state="finished"):
    result = {"agent_result": {"rollout_details": details} if details is not None else None}
    return {"id": "r1", "state": state, "task": {"name": "t"}, "rewards": rewards, "error_type": error_type,
            "result": result}


def test_multi_turn_rollout_details_become_one_sequence():
    turns = {"prompt_token_ids": [[1, 2], [1, 2, 5, 6, 7]], "completion_token_ids": [[5, 6], [8]],
             "logprobs": [[-0.1, -0.2], [-0.3]]}
    t = parse_trial(detail({"reward": 1}, [turns]), need_tokens=True)
    assert (t.reward, t.turns, t.prompt_ids) == (1.0, 2, [1, 2])
    assert t.response_ids == [5, 6, 7, 8] and t.loss_mask == [1, 1, 0, 1]
    assert t.logprobs == [-0.1, -0.2, 0.0, -0.3]


@pytest.mark.parametrize("bad, match", [
    (detail({"reward": 1}, error_type="RuntimeError"), "the trial failed: RuntimeError"),
    (detail(None), "no usable reward"),
    (detail({"reward": float("nan")}), "no usable reward"),
    (detail({"a": 1, "b": 0}), "no usable reward"),
    (detail({"reward": 1}), "no token ids"),
    (detail({"reward": 1}, [{"prompt_token_ids": [[1]], "completion_token_ids": [[2]]}]), "one per turn"),
    (detail({"reward": 1}, [{"prompt_token_ids": [[1]], "completion_token_ids": [[2, 3]], "logprobs": [[-1]]}]),
     "2 completion tokens but 1 log-probs"),
    (detail({"reward": 1}, [{"prompt_token_ids": [[1], [9, 2]], "completion_token_ids": [[2], [3]],
                             "logprobs": [[-1], [-1]]}]), "does not extend"),
])
def test_unusable_trials_say_why(bad, match):
    with pytest.raises(BadTrial, match=match):
        parse_trial(bad, need_tokens=True)


def test_scoring_without_tokens_keeps_the_reward_and_trains_nothing():
    task = Task(prompt="p", metadata={"name": "t", "path": "/x"})
    s = HarborRollout(HarborRolloutConfig(require_token_data=False))._sample(task, detail({"reward": 1}), None, 3)
    assert (s.status, s.reward, s.loss_mask, s.weight_version) == (Status.COMPLETED, 1.0, [0], 3)
    s = HarborRollout(HarborRolloutConfig())._sample(task, detail({"reward": 1}), None, 3)
    assert (s.status, s.reward, s.loss_mask) == (Status.FAILED, 0.0, [0])
    assert "no token ids" in s.extensions["harbor"]["error"]
    s = HarborRollout(HarborRolloutConfig(require_token_data=False))._sample(
        task, detail({"reward": 1}, state="cancelled"), None, 3)
    assert s.status == Status.FAILED and "cancelled" in s.extensions["harbor"]["error"]


def test_bundled_tasks_and_the_job_config():
    env = HarborEnv(HarborConfig())
    train = env.tasks("train")
    assert [t.metadata["name"] for t in train] == ["sum-2-5", "sum-3-4"] and "2+5" in train[0].prompt
    cfg = job_config(env.cfg, train, 3)
    assert cfg["n_attempts"] == 3 and cfg["agents"] == [{"name": "oracle"}]
    assert cfg["environment"] == {"type": "podman"} and [t["path"] for t in cfg["tasks"]] == \
        [t.metadata["path"] for t in train]


def test_missing_task_folders_name_the_key(tmp_path):
    with pytest.raises(MilesError, match="env.tasks_dir.*not a folder"):
        task_folders(str(tmp_path / "nope"), "env.tasks_dir")
    with pytest.raises(MilesError, match="env.eval_tasks_dir.*no task folders"):
        task_folders(str(tmp_path), "env.eval_tasks_dir")


def test_a_server_that_is_down_is_a_clear_error():
    env = HarborEnv(HarborConfig(server_url="http://127.0.0.1:9", request_timeout_s=2))
    with pytest.raises(MilesError, match="cannot connect to the Harbor server.*env.server_url"):
        HarborRollout(HarborRolloutConfig()).generate(env.tasks("eval"), 1, engine=None, env=env,
                                                      tokenizer=None, params=None)


def test_the_miles_agent_gets_the_rollouts_sampling_settings_and_an_absolute_tokenizer_dir(monkeypatch, tmp_path):
    from miles import SamplingParams

    monkeypatch.chdir(tmp_path)
    agent = {"import_path": "miles_harbor_agent:MilesAgent", "kwargs": {"policy_url": "http://p", "tokenizer_dir":
                                                                         "policy", "temperature": 0.5}}
    env = HarborEnv(HarborConfig(agent=agent))
    cfg = job_config(env.cfg, env.tasks("eval"), 1, SamplingParams(temperature=0.0, max_new_tokens=5))
    (got,) = cfg["agents"]
    assert got["import_path"] == agent["import_path"] and got["kwargs"]["policy_url"] == "http://p"
    assert got["kwargs"]["tokenizer_dir"] == str(tmp_path / "policy")
    assert (got["kwargs"]["temperature"], got["kwargs"]["max_new_tokens"]) == (0.0, 5)  # greedy evaluation
    assert env.cfg.agent["kwargs"]["tokenizer_dir"] == "policy"  # the config itself is left as it was
    other = HarborEnv(HarborConfig(agent={"name": "terminus-2", "kwargs": {"x": 1}}))
    assert job_config(other.cfg, other.tasks("eval"), 1, SamplingParams())["agents"] == [
        {"name": "terminus-2", "kwargs": {"x": 1}}]


def test_the_agents_weight_versions_reach_the_sample():
    turns = {"prompt_token_ids": [[1, 2], [1, 2, 5, 6]], "completion_token_ids": [[5], [8]],
             "logprobs": [[-0.1], [-0.3]], "extra": {"weight_version": [4, 5]}}
    task = Task(prompt="p", metadata={"name": "t", "path": "/x"})

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(str, ids))

    s = HarborRollout(HarborRolloutConfig())._sample(task, detail({"reward": 0.5}, [turns]), Tok(), 7)
    assert (s.weight_version, s.weight_versions, s.reward, s.response) == (4, [4, 5], 0.5, "568")
    del turns["extra"]
    s = HarborRollout(HarborRolloutConfig())._sample(task, detail({"reward": 0.5}, [turns]), Tok(), 7)
    assert (s.weight_version, s.weight_versions) == (7, [7])


def test_the_env_tokenizer_and_the_tiny_policy_need_no_pytest():
    """A user's install runs the connector without test tools: in a fresh interpreter with pytest
    blocked the env and the tiny policy module import and the env's tokenizer works, and no import
    in the tiny policy or miles_tinypolicy, the ones inside functions included (torch,
    transformers), names pytest or miles.testing (the model itself is torch's and transformers':
    conftest.py writes one)."""
    import miles_tinypolicy
    from miles_plugin_harbor import tiny_policy

    code = ("import sys; sys.modules['pytest'] = None\n"
            "from miles_plugin_harbor import tiny_policy\n"
            "from miles_plugin_harbor.config import HarborConfig\nfrom miles_plugin_harbor.env import HarborEnv\n"
            "tok = HarborEnv(HarborConfig(chars='ab')).tokenizer()\n"
            "assert tok('ab', add_special_tokens=False)['input_ids'] == [3, 4]")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    names = imported_modules(tiny_policy) | imported_modules(miles_tinypolicy)
    assert {"miles_tinypolicy", "torch", "transformers"} <= names, names  # the scan sees the lazy imports
    assert not [n for n in names if n.split(".")[0] in ("pytest", "_pytest") or n.startswith("miles.testing")]
