import math

import pytest
import torch
from miles import Group, MilesError, Sample, Task
from miles_plugin_flow_grpo.algorithm import FlowGRPO, clipped_loss
from miles_rlmath import group_advantages
from miles_plugin_flow_grpo.config import FlowGRPOConfig
from pydantic import ValidationError

T, C, H = 4, 3, 8


def _sample(reward: float, seed: int) -> Sample:
    g = torch.Generator().manual_seed(seed)
    traj = {"latents": torch.randn(T + 1, C, H, H, generator=g), "sigmas": torch.linspace(1, 0, T + 1),
            "embeds": torch.randn(5, 16, generator=g), "pooled": torch.randn(16, generator=g),
            "eta": 0.7, "guidance": 1.0, "stochastic": True}
    return Sample(task=Task("a red square"), prompt_ids=[2, 4, 5, 3], response_ids=[],
                  logprobs=torch.randn(T, generator=g).tolist(), loss_mask=[1] * T, reward=reward,
                  extensions={"diffusers": traj})


def test_group_advantages_normalise_within_a_group():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])  # the GRPO family's rule: unbiased std
    assert adv == pytest.approx([x / math.sqrt(1 / 3) for x in (0.5, -0.5, -0.5, 0.5)], abs=1e-5)
    assert FlowGRPO().advantages([Group(Task("x"), [_sample(r, i) for i, r in enumerate([1, 0, 0, 1])])]) == [adv]
    assert group_advantages([1.0, 0.0], std_normalize=False) == [0.5, -0.5]
    assert group_advantages([3.0]) == [0.0]
    algo = FlowGRPO(FlowGRPOConfig(adv_clip=0.5))
    groups = [Group(Task("x"), [_sample(r, i) for i, r in enumerate([1, 0, 0, 0])])]
    assert algo.advantages(groups)[0] == pytest.approx([0.5, -0.5, -0.5, -0.5], abs=1e-5)


def test_zero_variance_groups_are_dropped():
    algo = FlowGRPO()
    assert not algo.keep(Group(Task("x"), [_sample(1.0, 0), _sample(1.0, 1)]))
    assert algo.keep(Group(Task("x"), [_sample(1.0, 0), _sample(0.0, 1)]))
    assert FlowGRPO(FlowGRPOConfig(filter_zero_variance=False)).keep(Group(Task("x"), [_sample(1.0, 0)] * 2))


def test_make_batch_shapes_and_step_subset():
    samples = [_sample(r, i) for i, r in enumerate([1.0, 0.0, 1.0])]
    batch = FlowGRPO(FlowGRPOConfig(step_fraction=0.5)).make_batch(samples, 0, [1.0, -2.0, 0.5])
    assert batch.input_ids is None and batch.attention_mask is None and batch.position_ids is None
    for t in (batch.loss_mask, batch.advantages, batch.rollout_logprobs):
        assert t.shape == (3, T)
    assert batch.loss_mask[0].tolist() == [1, 1, 0, 0] and batch.global_tokens == 6
    assert batch.advantages[1].tolist() == [-2.0, -2.0, 0.0, 0.0]
    assert batch.rollout_logprobs[2].tolist() == pytest.approx(samples[2].logprobs)
    assert batch.extras["latents"].shape == (3, T + 1, C, H, H) and batch.extras["pooled"].shape == (3, 16)
    assert batch.extras["eta"] == 0.7 and batch.rewards.tolist() == [1.0, 0.0, 1.0]
    sub = batch.select([2, 0])  # the kernel's row selection slices extras too
    assert torch.equal(sub.extras["latents"][0], batch.extras["latents"][2])


def test_make_batch_errors_name_the_fix():
    bare = Sample(task=Task("x"), logprobs=[0.0] * T, loss_mask=[1] * T)
    with pytest.raises(MilesError, match="trajectory_key"):
        FlowGRPO().make_batch([bare], 0, [0.0])
    with pytest.raises(MilesError, match="one log-prob per denoising step"):
        FlowGRPO().make_batch([Sample(task=Task("x"))], 0, [0.0])
    with pytest.raises(ValidationError):
        FlowGRPOConfig(step_fraction=0)
    with pytest.raises(ValidationError):
        FlowGRPOConfig(clip=0.1)


def test_clipped_loss_and_kl():
    lp = torch.log(torch.tensor([[1.5, 0.5]]))
    per, ratio, clipped = clipped_loss(lp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), 0.2)
    # positive advantage: the ratio's gain is capped at 1.2; a ratio below 1 is not clipped
    assert per.tolist()[0] == pytest.approx([-1.2, -0.5]) and clipped.tolist() == [[1.0, 0.0]]
    samples = [_sample(1.0, 0), _sample(0.0, 1)]
    algo = FlowGRPO(FlowGRPOConfig(kl_coef=0.5))
    assert algo.needs_reference and not FlowGRPO().needs_reference
    batch = algo.make_batch(samples, 0, [1.0, -1.0])
    batch.ref_logprobs = batch.rollout_logprobs + 0.1
    logprobs = batch.rollout_logprobs.clone().requires_grad_(True)
    loss, m = algo.loss(batch, logprobs)
    kl = math.exp(0.1) - 0.1 - 1
    assert m["kl"] == pytest.approx(kl, rel=1e-4) and m["ratio_mean"] == pytest.approx(1.0)
    assert float(loss) == pytest.approx(0.5 * kl, rel=1e-4)  # advantages +1/-1 cancel at ratio 1
    loss.backward()
    assert logprobs.grad[0].sum() < 0 < logprobs.grad[1].sum()  # raise the good sample, lower the bad


def test_the_ode_sampler_is_refused_before_anything_is_built():
    """flow-grpo's own config check: the diffusion rollout's ODE sampler records no log-probs."""
    from pathlib import Path

    from miles import ConfigError
    from miles.cli import load

    recipe = str(Path(__file__).resolve().parents[4] / "recipes" / "diffusion_quickstart.yaml")
    _, config = load(recipe, ["rollout.sampler=sde"], [])
    assert config.name("algorithm") == "flow-grpo"
    with pytest.raises(ConfigError, match="rollout.sampler: algorithm flow-grpo needs the SDE sampler"):
        load(recipe, ["rollout.sampler=ode"], [])
