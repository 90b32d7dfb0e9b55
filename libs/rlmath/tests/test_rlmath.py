"""miles_rlmath against hand-computed values; the numerical guards; the single-sample rule.

Every expected number is worked out in the comment above it (a calculator for the exp/sqrt digits,
never the code under test). The loss functions' use inside the algorithms is tested by the
grpo/ppo/distill plugins' own tests.
"""
import math
import subprocess
import sys
from types import SimpleNamespace

import miles_rlmath as M
import pytest
import torch

# --- group advantages ---------------------------------------------------------------------------

def test_group_advantages_grpo_and_dr_grpo():
    # [2, 0, 1]: mean 1, deviations [1, -1, 0], unbiased var (1 + 1 + 0) / 2 = 1, std 1
    assert M.group_advantages([2, 0, 1]) == pytest.approx([1 / 1.000001, -1 / 1.000001, 0.0])
    # Dr.GRPO / REINFORCE++-baseline: centred only
    assert M.group_advantages([3, 0, 0], std_normalize=False) == pytest.approx([2.0, -1.0, -1.0])
    assert M.group_advantages([5, 5]) == [0.0, 0.0]  # std 0: deviations 0, no division


@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("reward", [0.0, 1.0, -3.5, 1e6])
def test_single_sample_group_gets_zero(reward, std_normalize):
    # a lone sample's only baseline is itself: r - mean(r) = 0 whatever r is
    assert M.group_advantages([reward], std_normalize) == [0.0]
    assert M.group_advantages([]) == []


def test_group_advantages_are_shift_invariant():
    # adding a constant to every reward changes nothing (true of groups of any size, 1 included)
    for rewards in ([1.0, 0.0, 0.0, 1.0], [0.3, 0.9], [0.7]):
        shifted = [r + 10.0 for r in rewards]
        assert M.group_advantages(shifted) == pytest.approx(M.group_advantages(rewards), abs=1e-6)


# --- masked means -------------------------------------------------------------------------------

def test_masked_mean_and_row_mean():
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert M.masked_mean(x, m) == pytest.approx(7 / 3)  # (1 + 2 + 4) / 3
    assert M.row_mean(x, m).tolist() == pytest.approx([1.5, 4.0])
    assert M.row_mean(x, torch.zeros_like(m)).tolist() == [0.0, 0.0]  # empty rows: 0, not NaN
    assert M.masked_mean(x, torch.zeros_like(m)) == 0.0


def test_masked_whiten_by_hand():
    x = torch.tensor([[2.0, 4.0, 50.0], [6.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # entries 2, 4, 6: mean 4, deviations -2, 0, 2, unbiased var 8 / 2 = 4, std 2 (+1e-8 inside)
    assert M.masked_whiten(x, m).tolist() == [pytest.approx([-1.0, 0.0, 0.0]), pytest.approx([1.0, 0.0, 0.0])]


def _batch(mask, global_tokens=None, global_samples=None):
    """A stand-in with the three aggregation methods of miles.Batch (global denominators)."""
    mask = torch.tensor(mask)
    gt = float(mask.sum()) if global_tokens is None else global_tokens
    gs = mask.shape[0] if global_samples is None else global_samples
    return SimpleNamespace(
        loss_mask=mask, global_samples=gs,
        token_mean=lambda x: (x * mask).sum() / gt,
        seq_mean=lambda x: ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / gs)


def test_aggregate_modes_by_hand():
    x = torch.tensor([[1.0, 3.0, 9.0], [6.0, 0.0, 0.0]])
    b = _batch([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(M.aggregate(b, x, "token-mean")) == pytest.approx(10 / 3)  # (1 + 3 + 6) / 3
    assert float(M.aggregate(b, x, "seq-mean-token-mean")) == pytest.approx(4.0)  # (2 + 6) / 2
    # Dr.GRPO: (4 / 8 + 6 / 8) / 2 sequences
    assert float(M.aggregate(b, x, "seq-mean-token-sum-norm", max_response_len=8)) == pytest.approx(0.625)
    with pytest.raises(ValueError, match="unknown loss_agg 'sum'"):
        M.aggregate(b, x, "sum")


# --- returns, GAE, value loss ----------------------------------------------------------------------

def test_gae_two_steps_by_hand():
    r = torch.tensor([[0.0, 1.0]])
    v = torch.tensor([[0.5, 0.2]])
    m = torch.ones(1, 2)
    # gamma 1, lam 0.5: delta_1 = 1 - 0.2 = 0.8, A_1 = 0.8; delta_0 = 0 + 0.2 - 0.5 = -0.3,
    # A_0 = -0.3 + 0.5 * 0.8 = 0.1; returns A + V = [0.6, 1.0]
    adv, ret = M.gae(r, v, m, gamma=1.0, lam=0.5)
    assert adv.tolist() == [pytest.approx([0.1, 0.8])]
    assert ret.tolist() == [pytest.approx([0.6, 1.0])]


def test_terminal_rewards_and_returns():
    m = torch.tensor([[1.0, 1.0, 0.0]])
    tr = M.terminal_rewards(torch.tensor([4.0]), m)
    assert tr.tolist() == [[0.0, 4.0, 0.0]]
    assert M.discounted_returns(tr, m, 0.5).tolist() == [[2.0, 4.0, 0.0]]  # 0 + 0.5 * 4, 4


def test_value_clip_loss_and_explained_variance():
    v, old, ret = torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.5])
    # plain (1 - 0.5)^2 = 0.25; clipped V = 0 + clip(1, +-0.2) = 0.2, (0.2 - 0.5)^2 = 0.09 -> 0.25
    loss, clipped = M.value_clip_loss(v, old, ret, 0.2)
    assert loss.tolist() == pytest.approx([0.25]) and clipped.tolist() == [False]
    m = torch.ones(1, 4)
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert M.explained_variance(returns, returns, m) == pytest.approx(1.0)
    # V = mean(R): Var(R - V) = Var(R) -> 0
    assert M.explained_variance(torch.full((1, 4), 2.5), returns, m) == pytest.approx(0.0)


# --- KL estimators and their clamps ----------------------------------------------------------------

def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    # lr = [0.5, -1]
    assert M.kl_estimate(lp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert M.kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    # k3 = exp(-lr) - 1 + lr: e^-0.5 - 0.5 = 0.10653066, e^1 - 2 = 0.71828183
    assert M.kl_estimate(lp, ref, "k3").tolist() == pytest.approx([0.10653066, 0.71828183])
    assert M.kl_estimate(lp, ref, "low_var_kl").tolist() == pytest.approx([0.10653066, 0.71828183])
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        M.kl_estimate(lp, ref, "k4")


def test_k3_is_clamped_to_ten():
    # lr = -3: e^3 - 1 - 3 = 16.0855 > 10 -> 10; lr = +30: -lr clamped to -20,
    # e^-20 - 1 + 20 = 19.0000 -> 10
    out = M.kl_estimate(torch.tensor([-3.0, 30.0]), torch.zeros(2), "k3")
    assert out.tolist() == pytest.approx([10.0, 10.0])
    # just below the clamp: lr = -2.5 -> e^2.5 - 1 - 2.5 = 8.6824940
    assert float(M.kl_estimate(torch.tensor(-2.5), torch.tensor(0.0))) == pytest.approx(8.6824940, rel=1e-6)


@pytest.mark.parametrize("lr", [-20.0, -25.0, -35.0, -50.0])
def test_k3_value_and_gradient_stay_finite_far_from_the_reference(lr):
    # Without the clamps the value would be e^-lr - 1 + lr (4.85e8 at -20) and its gradient
    # 1 - e^-lr (-4.85e8); with them both are bounded.
    logp = torch.tensor([lr], requires_grad=True)
    kl = M.kl_estimate(logp, torch.zeros(1), "k3")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and float(kl.detach()) == pytest.approx(10.0)
    assert torch.isfinite(logp.grad).all() and abs(float(logp.grad)) <= 1.0


def test_k3_gradient_matches_the_formula_inside_the_clamp():
    # d/dlr (e^-lr - 1 + lr) = 1 - e^-lr; at lr = 0.5: 1 - 0.60653066 = 0.39346934
    logp = torch.tensor([0.5], requires_grad=True)
    M.kl_estimate(logp, torch.zeros(1), "k3").sum().backward()
    assert float(logp.grad) == pytest.approx(0.39346934, rel=1e-6)


# --- ratios ---------------------------------------------------------------------------------------

def test_clamped_log_ratio_and_ppo_clip_stay_finite():
    lp = torch.tensor([[100.0, -100.0, math.log(1.5)]], requires_grad=True)
    old = torch.zeros(1, 3)
    assert M.clamped_log_ratio(lp, old).tolist() == [pytest.approx([20.0, -20.0, math.log(1.5)])]
    # A = 1, clip 0.2: ratio e^20 -> max(-e^20, -1.2) = -1.2; ratio e^-20 -> max(-2e-9, -0.8)
    # = -2.06e-9 (unclipped); ratio 1.5 -> -1.2 (clipped)
    loss, clipped = M.ppo_clip_loss(lp, old, torch.ones(1, 3), 0.2)
    assert loss.tolist() == [pytest.approx([-1.2, -math.exp(-20), -1.2])]
    assert clipped.tolist() == [[True, False, True]]
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_tis_and_mismatch_use_the_clamp():
    old = torch.tensor([[50.0, 0.0, math.log(3.0)]])
    roll = torch.zeros(1, 3)
    # ratios e^20 (clamped), 1, 3 -> TIS capped at 2: [2, 1, 2]; band [0.5, 2]: keep [0, 1, 0]
    assert M.tis_weights(old, roll, 2.0).tolist() == [pytest.approx([2.0, 1.0, 2.0])]
    assert M.mismatch_keep(old, roll, 0.5, 2.0).tolist() == [[0.0, 1.0, 0.0]]


def test_sequence_log_ratio_is_masked_mean():
    lp = torch.tensor([[0.3, 0.1, 9.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    assert M.sequence_log_ratio(lp, torch.zeros(1, 3), m).tolist() == [pytest.approx([0.2, 0.2, 0.2])]
    # a sequence log-ratio of (30 + 14) / 2 = 22 is capped at 10 (verl's GSPO cap); -22 is not
    far = torch.tensor([[30.0, 14.0], [-30.0, -14.0]])
    out = M.sequence_log_ratio(far, torch.zeros(2, 2), torch.ones(2, 2))
    assert out.tolist() == [[10.0, 10.0], [-22.0, -22.0]]


# --- packaging ------------------------------------------------------------------------------------

def test_importing_the_package_and_its_config_does_not_import_torch():
    code = ("import sys, miles_rlmath; from miles_rlmath import PolicyLossConfig; "
            "PolicyLossConfig(kl_estimator='k3'); assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'miles' not in sys.modules, 'the kernel imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        M.nope  # noqa: B018
