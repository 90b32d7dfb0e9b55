"""PPO: GAE advantages from the critic's values, clipped value loss, wiring into the loop.

Expected numbers are worked out by hand in the comments.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import miles
import pytest
import torch
from miles.protocols import Algorithm
from miles.testing import assert_lazy_registration, make_group
from miles_plugin_ppo.algorithm import PPO
from miles_plugin_ppo.config import PPOConfig
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[4]


def batch_of(lengths, rewards, rollout_logprobs=None):
    task = miles.Task(prompt="p")
    samples = [miles.Sample(task=task, prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)),
                            logprobs=(rollout_logprobs[i] if rollout_logprobs else []), reward=rewards[i])
               for i, n in enumerate(lengths)]
    return miles.Batch.from_samples(samples, pad_id=0, advantages=list(rewards))


def test_outcomes_and_no_group_filter():
    algo = PPO()
    assert algo.needs_critic and algo.uses_rollout and not algo.needs_reference
    assert algo.advantages([make_group([1, 0]), make_group([1])]) == [[1, 0], [1]]
    assert algo.keep(make_group([1, 1, 1]))  # the critic is the baseline: equal rewards still teach


def test_prepare_gae_returns_and_metrics():
    b = batch_of([3], [1.0])
    b.extras["values"] = torch.tensor([[0.5, 0.6, 0.8]])
    m = PPO(PPOConfig(lam=0.5, normalize_advantages=False)).prepare(b)
    # terminal reward 1 at t2; gamma 1, lam 0.5: A = [0.25, 0.3, 0.2], R = A + V = [0.75, 0.9, 1.0]
    assert b.advantages.tolist()[0] == pytest.approx([0.25, 0.3, 0.2])
    assert b.extras["returns"].tolist()[0] == pytest.approx([0.75, 0.9, 1.0])
    assert m["value_mean"] == pytest.approx(1.9 / 3) and m["return_mean"] == pytest.approx(2.65 / 3)
    # explained variance: Var(R) = (0.1333^2 + 0.01667^2 + 0.11667^2)/3 = 0.0105556,
    # Var(R - V) = Var([0.25, 0.3, 0.2]) = 0.0016667 -> 1 - 0.157895 = 0.842105
    assert m["explained_variance"] == pytest.approx(0.842105, abs=1e-5)
    b = batch_of([3], [1.0])
    b.extras["values"] = torch.tensor([[0.5, 0.6, 0.8]])
    PPO(PPOConfig(lam=0.5)).prepare(b)
    # whitened: mean 0.25, unbiased std 0.05 -> [0, 1, -1]
    assert b.advantages.tolist()[0] == pytest.approx([0.0, 1.0, -1.0], abs=1e-5)


def test_prepare_with_kl_in_reward_and_padding():
    b = batch_of([2, 1], [1.0, 0.0], rollout_logprobs=[[-1.0, -1.0], [-2.0]])
    b.ref_logprobs = torch.tensor([[-1.5, -1.0], [-1.0, 0.0]])
    b.extras["values"] = torch.tensor([[0.2, 0.4], [0.1, 9.0]])  # 9.0 sits on padding
    algo = PPO(PPOConfig(lam=1.0, kl_reward_coef=0.2, kl_estimator="k1", normalize_advantages=False))
    assert algo.needs_reference
    m = algo.prepare(b)
    # k1 kl = [0.5, 0 | -1]; rewards: row 0 [-0.1, 1.0], row 1 [0.2 + 0] (its outcome is 0)
    # row 0, lam 1, gamma 1: A1 = 1.0 - 0.4 = 0.6; A0 = -0.1 + 0.4 - 0.2 + 0.6 = 0.7; R = [0.9, 1.0]
    # row 1: A0 = 0.2 - 0.1 = 0.1; R = 0.2; padding stays 0
    assert b.advantages.tolist() == [pytest.approx([0.7, 0.6]), pytest.approx([0.1, 0.0])]
    assert b.extras["returns"].tolist() == [pytest.approx([0.9, 1.0]), pytest.approx([0.2, 0.0])]
    assert m["kl_reward"] == pytest.approx(-0.5 / 3)


def test_prepare_needs_values():
    with pytest.raises(ValueError, match="values"):
        PPO().prepare(batch_of([1], [1.0]))


def test_value_loss_by_hand():
    b = batch_of([3], [1.0])
    b.extras["values"] = torch.tensor([[0.2, 0.2, 0.2]])
    b.extras["returns"] = torch.tensor([[1.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 1.0, 0.2]], requires_grad=True)
    loss, m = PPO(PPOConfig(value_clip=0.2)).value_loss(b, v)
    # per token [0.36 (clipped), 1.0, 0.64]; token-mean 2.0/3
    assert loss.item() == pytest.approx(2.0 / 3)
    assert m["value_loss"] == pytest.approx(2.0 / 3) and m["value_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # t0: the clipped term wins and V_clip no longer moves with V -> 0; t1: 2*(1 - 0)/3;
    # t2: 2*(0.2 - 1)/3 (both terms agree)
    assert v.grad.tolist()[0] == pytest.approx([0.0, 2 / 3, -1.6 / 3])


def test_policy_loss_is_the_shared_clipped_loss_with_entropy():
    b = batch_of([2], [1.0])
    b.advantages = torch.tensor([[1.0, -1.0]])
    lp = torch.full((1, 2), -1.0)
    loss, m = PPO(PPOConfig(entropy_coef=0.5)).loss(b, lp)
    # ratio 1: pg = mean(-A) = 0; entropy estimate -lp = 1 -> loss = -0.5
    assert loss.item() == pytest.approx(-0.5) and m["entropy"] == pytest.approx(1.0)


def test_config():
    with pytest.raises(ValidationError, match="lam"):
        PPOConfig(lam=1.5)
    with pytest.raises(ValidationError, match="unknown_key|extra"):
        PPOConfig(unknown_key=1)
    for name, field in PPOConfig.model_fields.items():
        assert field.description, f"{name} has no description"


def test_registered_lazily_and_through_entry_point():
    assert_lazy_registration("miles_plugin_ppo", "algorithms", "ppo")
    pm = miles.make_plugin_manager(autoload=True, allow=["ppo"])
    algo = pm.create("algorithms", "ppo", PPOConfig(critic_lr=1e-3))
    assert isinstance(algo, PPO) and isinstance(algo, Algorithm) and algo.critic_lr == 1e-3


REWARD = """
from miles import hookimpl

@hookimpl
def miles_reward(sample):
    return 1.0 if sample.response.startswith("1") else 0.0
"""


def test_loop_trains_the_critic_and_resumes_it(tmp_path):
    """tiny.yaml with ppo: the critic gets gradients, its state is checkpointed and resumed."""
    plugin = tmp_path / "starts_with_one.py"
    plugin.write_text(REWARD)
    out = tmp_path / "run"

    def train(steps):
        cmd = [sys.executable, "-m", "miles.cli", "train", "tests/tiny.yaml", "--plugin", str(plugin),
               f"run.out_dir={out}", f"run.steps={steps}", "algorithm.name=ppo",
               "algorithm.critic_lr=1e-3", "run.warm_start=null"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    rows = train(4)
    steps = [r for r in rows if r["step"] > 0 and "value_loss" in r]
    assert len(steps) == 4
    assert all(r["critic_grad_norm"] > 0 for r in steps)  # non-zero rewards reach the critic
    assert steps[-1]["value_pred_mean"] != 0.0  # the zero-initialised head has moved
    assert (out / "checkpoints" / "step_000004" / "trainer" / "critic.pt").is_file()
    rows = train(6)
    assert [r["step"] for r in rows] == list(range(7))
    # the resumed critic continues from its trained state: values are not back at exactly 0
    assert rows[5]["value_mean"] != 0.0
