"""Against a real ``harbor serve`` (Harbor's own Python 3.12 venv) running real trials in podman
containers built from a local image, and ``miles serve`` with a tiny policy; both servers come
from conftest.py, started once for this file. The ``oracle`` agent (each task's solution: a fixed
policy) is scored by each task's verifier through the connector; ``miles train recipes/harbor.yaml``
runs trials whose agent, ``miles_harbor_agent:MilesAgent``, plays each task with the policy on
``miles serve``, and every sample the run scores is checked against what the agent logged of the
policy server's own answers in that trial."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
from miles.types import Status

ROOT = Path(__file__).resolve().parents[4]
TASKS = Path(__file__).resolve().parents[1] / "miles_plugin_harbor" / "tasks" / "train"

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("policy_started")]  # loads while harbor serve starts


def tasks_dir(tmp_path: Path) -> Path:
    """The bundled tasks, one whose solution is wrong and one whose image cannot be built."""
    root = tmp_path / "tasks"
    shutil.copytree(TASKS, root)
    wrong = root / "sum-wrong"
    shutil.copytree(TASKS / "sum-3-4", wrong)
    (wrong / "solution" / "solve.sh").write_text("#!/bin/bash\necho 8 > /app/answer.txt\n")
    broken = root / "sum-broken"
    shutil.copytree(TASKS / "sum-3-4", broken)
    (broken / "environment" / "Dockerfile").write_text("FROM localhost/miles-harbor-missing:latest\n")
    return root


def test_trials_run_in_containers_and_their_rewards_reach_the_samples(server, tmp_path):
    from miles_plugin_harbor.client import HarborClient
    from miles_plugin_harbor.config import HarborConfig, HarborRolloutConfig
    from miles_plugin_harbor.env import HarborEnv
    from miles_plugin_harbor.rollout import HarborRollout, job_config, run_job

    client = HarborClient(server.url)
    assert "oracle" in client.agents() and "podman" in client.sandboxes()
    env = HarborEnv(HarborConfig(server_url=server.url, tasks_dir=str(tasks_dir(tmp_path)), job_timeout_s=400,
                                 jobs_dir=str(tmp_path / "jobs")))
    tasks = env.tasks("train")
    assert client.submit(job_config(env.cfg, tasks, 2), dry_run=True) == {"n_trials": 8}

    details = run_job(client, job_config(env.cfg, tasks, 1), env.cfg.job_timeout_s, 1.0)
    client.close()
    scoring = HarborRollout(HarborRolloutConfig(require_token_data=False))
    by_name = {t.metadata["name"]: t for t in tasks}
    samples = {d["task"]["name"]: scoring._sample(by_name[d["task"]["name"]], d, None, 0) for d in details}
    assert sorted(samples) == ["sum-2-5", "sum-3-4", "sum-broken", "sum-wrong"]
    assert samples["sum-2-5"].reward == samples["sum-3-4"].reward == 1.0  # the verifier ran in the container
    assert samples["sum-wrong"].reward == 0.0 and samples["sum-wrong"].status == Status.COMPLETED
    broken = samples["sum-broken"]
    assert broken.status == Status.FAILED and "the trial failed" in broken.extensions["harbor"]["error"]
    # training needs the policy's tokens: the oracle agent records none, so each trial says so
    training = HarborRollout(HarborRolloutConfig())
    assert all("no token ids" in training._sample(by_name[d["task"]["name"]], d, None, 0).extensions["harbor"]["error"]
               for d in details if d["task"]["name"] != "sum-broken")
    leftover = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
                              env=server.environment(Path(server.proc.args[0]).parents[1])).stdout
    assert "sum-" not in leftover, leftover  # Harbor removed every trial container


# a launch-time plugin: sees every sample the run scores (training and evaluation), changes nothing
DUMP = '''import json, os
from miles import hookimpl


@hookimpl
def miles_reward(sample):
    row = {k: getattr(sample, k) for k in ("prompt_ids", "response_ids", "logprobs", "loss_mask", "reward",
                                           "weight_version")}
    row.update(status=sample.status.value, harbor=sample.extensions.get("harbor"))
    with open(os.environ["HARBOR_SAMPLES"], "a") as f:
        f.write(json.dumps(row) + "\\n")
    return None
'''


def agent_turns(client, rollout_id: str) -> list[dict]:
    """The agent's log of that trial: per turn the ids it sent and the policy server's answer."""
    uri = client.rollout(rollout_id)["artifacts"]["agent/miles_turns.jsonl"]
    return [json.loads(line) for line in Path(urlparse(uri).path).read_text().splitlines()]


def test_miles_trains_on_harbor_trials_with_the_policys_exact_tokens(server, policy, tmp_path):
    from miles_plugin_harbor.client import HarborClient

    out, dump = tmp_path / "run", tmp_path / "samples.jsonl"
    (tmp_path / "dump_samples.py").write_text(DUMP)
    cmd = [sys.executable, "-m", "miles.cli", "train", str(ROOT / "recipes/harbor.yaml"),
           "--plugin", str(tmp_path / "dump_samples.py"), f"model.path={policy['dir']}",
           f"env.server_url={server.url}", f"env.agent.kwargs.policy_url={policy['url']}",
           f"env.agent.kwargs.tokenizer_dir={policy['dir']}", f"engine.urls=[{policy['url']}]",
           "rollout.batch_size=1", "rollout.n=2", "env.agent.kwargs.max_turns=2", "run.steps=1",
           f"run.out_dir={out}",
           # a random policy rarely earns a reward: keep all-zero groups so every step trains
           "algorithm.filter_zero_variance=false"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420, env={
        **os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HARBOR_SAMPLES": str(dump)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1], rows
    for r in steps:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["turns_mean"] >= 1.0 and r["env_failed"] == 0.0, r
        # the trainer re-scores the samples' tokens: the engine's log-probs line up with them
        assert r["train_rollout_logprob_abs_diff"] < 1e-3, r
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 1]

    samples = [json.loads(line) for line in dump.read_text().splitlines()]
    # evaluation at step 0 (1 eval task), step 1 (1 task x 2 trials), evaluation after step 1
    assert len(samples) == 1 + 2 + 1, samples
    # each rollout used the weights of its time: the step's update reached miles serve by disk sync
    assert [s["weight_version"] for s in samples] == [0] * 3 + [1], samples
    client = HarborClient(server.url)
    for s in samples:
        assert s["status"] == "completed" and s["harbor"]["error"] == "", s
        turns = agent_turns(client, s["harbor"]["rollout_id"])
        assert s["harbor"]["turns"] == len(turns) >= 1 and len(turns) <= 2
        seq = s["prompt_ids"] + s["response_ids"]
        assert s["prompt_ids"] == turns[0]["input_ids"]
        policy_ids, policy_lps = [], []
        for t in turns:
            out_ids = t["response"]["output_ids"]
            assert seq[:len(t["input_ids"])] == t["input_ids"]  # the engine saw exactly this sequence so far
            assert seq[len(t["input_ids"]):len(t["input_ids"]) + len(out_ids)] == out_ids
            assert t["response"]["meta_info"]["weight_version"] == s["weight_version"]
            policy_ids += out_ids
            policy_lps += [lp for lp, _, _ in t["response"]["meta_info"]["output_token_logprobs"]]
        # loss_mask 1 on exactly the policy's tokens, with the engine's log-probs; 0 on the rest
        resp = list(zip(s["response_ids"], s["loss_mask"], s["logprobs"]))
        assert [i for i, m, _ in resp if m == 1] == policy_ids
        assert [lp for _, m, lp in resp if m == 1] == policy_lps
        assert all(lp == 0.0 for _, m, lp in resp if m == 0)
        assert sum(m == 0 for _, m, _ in resp) == len(seq) - len(s["prompt_ids"]) - len(policy_ids)
        # the reward is the trial's verifier's
        rewards = client.rollout(s["harbor"]["rollout_id"])["rewards"]
        assert s["reward"] == rewards["reward"] and s["reward"] in (0.0, 1.0)
    client.close()


def test_a_policy_server_that_is_down_fails_the_trial_and_a_bad_agent_option_the_job(server, policy):
    from miles import MilesError, SamplingParams
    from miles.types import Status
    from miles_plugin_harbor.config import HarborConfig, HarborRolloutConfig
    from miles_plugin_harbor.env import HarborEnv
    from miles_plugin_harbor.rollout import MILES_AGENT, HarborRollout

    def env(**kwargs):
        agent = {"import_path": MILES_AGENT, "kwargs": {"policy_url": "http://127.0.0.1:9",  # nothing listens
                                                        "tokenizer_dir": str(policy["dir"]), **kwargs}}
        return HarborEnv(HarborConfig(server_url=server.url, agent=agent, job_timeout_s=300))

    class Engine:
        weight_version = 0

    down = env()
    (group,) = HarborRollout(HarborRolloutConfig(max_failed_fraction=1.0)).generate(
        down.tasks("eval"), 1, engine=Engine(), env=down, tokenizer=None, params=SamplingParams(max_new_tokens=4))
    (s,) = group
    assert s.status == Status.FAILED and s.loss_mask == [0] and s.reward == 0.0
    assert "the trial failed" in s.extensions["harbor"]["error"] and "ConnectError" in s.extensions["harbor"]["error"]
    bad = env(max_turn=3)  # a misspelt option: Harbor's check of the agent's options refuses the job
    with pytest.raises(MilesError, match="(?s)not accepted.*Unknown option .max_turn."):
        HarborRollout(HarborRolloutConfig()).generate(bad.tasks("eval"), 1, engine=Engine(), env=bad,
                                                      tokenizer=None, params=SamplingParams())
