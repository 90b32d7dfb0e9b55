import math

import pytest
import torch
from miles import Group, MilesError, Sample, Task
from miles_plugin_diffusion_nft.algorithm import DiffusionNFT, implicit_policies, nft_loss, optimality
from miles_plugin_diffusion_nft.config import DiffusionNFTConfig
from pydantic import ValidationError

T, C, H = 3, 3, 4


def _sample(reward: float, seed: int, version: int = 2) -> Sample:
    g = torch.Generator().manual_seed(seed)
    traj = {"latents": torch.randn(T + 1, C, H, H, generator=g), "sigmas": torch.linspace(1, 0, T + 1),
            "embeds": torch.randn(5, 16, generator=g), "pooled": torch.randn(16, generator=g),
            "eta": 0.7, "guidance": 1.0, "stochastic": False}
    return Sample(task=Task("a red square"), prompt_ids=[2, 4, 5, 3], logprobs=[0.0] * T, loss_mask=[0] * T,
                  reward=reward, weight_version=version, extensions={"diffusers": traj})


def test_implicit_policies_and_a_hand_computed_loss():
    v, v_old, target = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])
    pos, neg = implicit_policies(v, v_old, 0.5)
    assert pos.tolist() == [0.5, 0.0] and neg.tolist() == [-0.5, 0.0]  # 0.5 v_old + 0.5 v, 1.5 v_old - 0.5 v
    assert torch.equal(pos + neg, 2 * v_old)  # the two mirror each other about the old policy
    v = v.clone().requires_grad_(True)
    loss, pos_err, neg_err = nft_loss(v, v_old, target, torch.tensor(0.75), 0.5)
    pos_err, neg_err = pos_err.detach(), neg_err.detach()
    # pos: mean((0.5-1)^2, (0-1)^2) = 0.625; neg: mean((-0.5-1)^2, (0-1)^2) = 1.625
    assert float(pos_err) == pytest.approx(0.625) and float(neg_err) == pytest.approx(1.625)
    assert float(loss.detach()) == pytest.approx(0.75 * 0.625 + 0.25 * 1.625)
    loss.backward()
    # d/dv: r*2*beta*(v+ - t)/D - (1-r)*2*beta*(v- - t)/D per component
    assert v.grad.tolist() == pytest.approx([0.75 * 0.5 * -0.5 - 0.25 * 0.5 * -1.5,
                                             0.75 * 0.5 * -1.0 - 0.25 * 0.5 * -1.0])


@pytest.mark.parametrize("r, closer", [(1.0, True), (0.0, False)])
def test_r1_pulls_the_velocity_to_the_target_and_r0_pushes_it_away(r, closer):
    g = torch.Generator().manual_seed(0)
    target, v_old = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    v = v_old.clone().requires_grad_(True)
    opt = torch.optim.SGD([v], lr=1.0)
    for _ in range(5):
        opt.zero_grad()
        nft_loss(v, v_old, target, torch.full((8,), r), 1.0)[0].sum().backward()
        opt.step()
    before, after = (v_old - target).norm(), (v.detach() - target).norm()
    assert (after < 0.9 * before) if closer else (after > 1.1 * before)


def test_optimality_probabilities():
    assert optimality([1.0, 0.0, 0.0, 1.0]) == pytest.approx([1.0, 0.0, 0.0, 1.0])
    z = math.sqrt(0.1875)  # population std of [1, 0, 0, 0]
    assert optimality([1.0, 0.0, 0.0, 0.0]) == pytest.approx([1.0] + [0.5 - 0.5 * 0.25 / z] * 3)
    assert optimality([0.3, 0.3]) == [0.5, 0.5]
    assert optimality([1.0, 0.0], z=4.0) == pytest.approx([0.5625, 0.4375])
    groups = [Group(Task("x"), [_sample(r, i) for i, r in enumerate(rs)]) for rs in ([1, 0], [1, 1])]
    assert DiffusionNFT().advantages(groups) == [[1.0, 0.0], [0.5, 0.5]]
    by_batch = DiffusionNFT(DiffusionNFTConfig(reward_norm="batch")).advantages(groups)
    assert by_batch[0] == pytest.approx(optimality([1, 0], z=math.sqrt(0.1875))) and by_batch[1] == [0.5, 0.5]
    assert DiffusionNFT(DiffusionNFTConfig(filter_zero_variance=True)).keep(groups[0])
    assert not DiffusionNFT(DiffusionNFTConfig(filter_zero_variance=True)).keep(groups[1])
    assert DiffusionNFT().keep(groups[1])


def test_make_batch_draws_forward_process_points():
    samples = [_sample(r, i) for i, r in enumerate([1.0, 0.0, 1.0])]
    algo = DiffusionNFT(DiffusionNFTConfig(noise_draws=5, ema_decay=0.3))
    batch = algo.make_batch(samples, 0, [0.9, 0.1, 0.5])
    ex = batch.extras
    assert ex["x_t"].shape == (3, 5, C, H, H) and ex["sigma_t"].shape == (3, 5) and ex["old_decay"] == 0.3
    assert batch.loss_mask.shape == (3, 5) and batch.global_tokens == 15 and batch.global_samples == 3
    assert batch.advantages[1].tolist() == pytest.approx([0.1] * 5)
    assert ((ex["sigma_t"] > 0) & (ex["sigma_t"] < 1)).all()
    x0 = torch.stack([s.extensions["diffusers"]["latents"][-1] for s in samples])[:, None]
    s = ex["sigma_t"][..., None, None, None]
    # x_t lies on the straight path from x0 along the target velocity (noise - x0)
    assert torch.allclose(ex["x_t"], x0 + s * ex["v_target"], atol=1e-6)
    assert ex["embeds"].shape == (3, 5, 16) and ex["pooled"].shape == (3, 16)
    assert all(s.logprobs == [] for s in batch.samples)  # no log-probs to compare with the trainer's
    again = algo.make_batch(samples, 0, [0.9, 0.1, 0.5])
    assert torch.equal(again.extras["x_t"], ex["x_t"])  # the draws depend on the weight version only
    other = algo.make_batch([_sample(1.0, i, version=3) for i in range(3)], 0, [0.5] * 3)
    assert not torch.equal(other.extras["sigma_t"], ex["sigma_t"])
    sub = batch.select([2, 0])
    assert torch.equal(sub.extras["x_t"][0], ex["x_t"][2]) and sub.extras["old_decay"] == 0.3
    # shift > 1 favours high noise, as the sampler's schedule does
    high = DiffusionNFT(DiffusionNFTConfig(noise_draws=64, shift=3.0)).make_batch(samples, 0, [0.5] * 3)
    assert float(high.extras["sigma_t"].mean()) > float(DiffusionNFT(DiffusionNFTConfig(noise_draws=64))
                                                        .make_batch(samples, 0, [0.5] * 3).extras["sigma_t"].mean())


def test_loss_reads_the_spec_velocities_and_checks_their_shape():
    samples = [_sample(r, i) for i, r in enumerate([1.0, 0.0])]
    algo = DiffusionNFT(DiffusionNFTConfig(noise_draws=2, beta=0.5))
    batch = algo.make_batch(samples, 0, [1.0, 0.0])
    D = C * H * H
    target = batch.extras["v_target"].reshape(2, 2, D)
    v_old = torch.zeros(2, 2, D)
    v = target.clone().requires_grad_(True)  # the policy on the targets
    scores = torch.cat([v.reshape(2, -1), v_old.reshape(2, -1)], dim=1)
    loss, m = algo.loss(batch, scores)
    expect, _, _ = nft_loss(target, v_old, target, batch.advantages, 0.5)
    assert float(loss.detach()) == pytest.approx(float(expect.mean()), rel=1e-5)
    assert m["flow_mse"] == pytest.approx(0.0) and m["optimality_mean"] == pytest.approx(0.5)
    assert m["old_policy_gap"] == pytest.approx(float((target ** 2).mean()), rel=1e-5)
    loss.backward()
    assert v.grad.abs().sum() > 0
    with pytest.raises(MilesError, match="forward-process velocities"):
        algo.loss(batch, torch.zeros(2, 3))


def test_errors_name_the_fix():
    with pytest.raises(MilesError, match="trajectory_key"):
        DiffusionNFT().make_batch([Sample(task=Task("x"))], 0, [0.5])
    with pytest.raises(ValidationError):
        DiffusionNFTConfig(ema_decay=1.0)
    with pytest.raises(ValidationError):
        DiffusionNFTConfig(bta=0.1)
