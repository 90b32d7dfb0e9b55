"""Against a real ``harbor serve`` (Harbor's own Python 3.12 venv) running real trials in podman
containers built from a local image: the ``oracle`` agent (each task's solution: a fixed policy)
is scored by each task's verifier, through the connector (the servers: conftest.py)."""
import shutil
import subprocess
from pathlib import Path

import pytest
from miles.types import Status

pytestmark = pytest.mark.slow
TASKS = Path(__file__).resolve().parents[1] / "miles_plugin_harbor" / "tasks" / "train"


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
