"""GSPO, REINFORCE++(-baseline) and the shared loss options, against hand-computed numbers.

Every expected value is worked out in the comment above it (a calculator was used for the
exp/sqrt digits, never the code under test).
"""
import math

import miles
import pytest
import torch
from miles.protocols import Algorithm
from miles.testing import assert_lazy_registration, make_group
from miles_plugin_grpo.algorithm import GRPO, GSPO, ReinforcePP
from miles_plugin_grpo.config import GRPOConfig, GSPOConfig, ReinforcePPConfig
from miles_rlmath import (
    discounted_returns,
    gae,
    masked_whiten,
    mismatch_keep,
    policy_loss,
    sampled_entropy,
    sequence_log_ratio,
    terminal_rewards,
    tis_weights,
    value_clip_loss,
)
from pydantic import ValidationError


def batch_of(lengths, advantages, masks=None, rollout_logprobs=None, rewards=None):
    """One sample per response length; per-sample advantages, loss masks, engine log-probs."""
    task = miles.Task(prompt="p")
    samples = [miles.Sample(task=task, prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)),
                            loss_mask=(masks[i] if masks else None),
                            logprobs=(rollout_logprobs[i] if rollout_logprobs else []),
                            reward=(rewards[i] if rewards else 0.0))
               for i, n in enumerate(lengths)]
    return miles.Batch.from_samples(samples, pad_id=0, advantages=advantages)


# --- pure estimators ----------------------------------------------------------------------------

def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # entries 1,2,3,4: mean 2.5, deviations -1.5,-0.5,0.5,1.5, sum of squares 5,
    # unbiased var 5/3, std sqrt(5/3 + 1e-8) = 1.2909944 -> -1.1618950, -0.3872983, ...
    out = masked_whiten(x, mask)
    assert out.tolist()[0] == pytest.approx([-1.1618950, -0.3872983, 0.3872983], abs=1e-6)
    assert out.tolist()[1] == pytest.approx([1.1618950, 0.0, 0.0], abs=1e-6)


def test_terminal_rewards_at_last_trainable_token():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = terminal_rewards(torch.tensor([2.0, 3.0, 5.0]), mask)
    # row 0 ends at index 1, row 1 at index 2 (index 1 is tool output), row 2 has no token
    assert out.tolist() == [[0, 2, 0, 0], [0, 0, 3, 0], [0, 0, 0, 0]]


def test_discounted_returns_skip_masked_tokens():
    r = torch.tensor([[0.0, 0.5, 7.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    # backwards, gamma 0.5: t3: G = 1; t2 masked (its 7 is ignored, no discount step): 0;
    # t1: 0.5 + 0.5*1 = 1.0; t0: 0 + 0.5*1.0 = 0.5
    assert discounted_returns(r, mask, 0.5).tolist() == [[0.5, 1.0, 0.0, 1.0]]
    # gamma 1: returns-to-go 1.5, 1.5, 0, 1
    assert discounted_returns(r, mask, 1.0).tolist() == [[1.5, 1.5, 0.0, 1.0]]


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.8]])
    m = torch.ones(1, 3)
    # gamma 1, lam 0.5: t2: delta = 1 + 0 - 0.8 = 0.2, A = 0.2; t1: delta = 0.8 - 0.6 = 0.2,
    # A = 0.2 + 0.5*0.2 = 0.3; t0: delta = 0.6 - 0.5 = 0.1, A = 0.1 + 0.5*0.3 = 0.25; R = A + V
    adv, ret = gae(r, v, m, gamma=1.0, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0.25, 0.3, 0.2])
    assert ret.tolist()[0] == pytest.approx([0.75, 0.9, 1.0])
    # gamma 0.9, lam 1 (Monte Carlo): A2 = 0.2; A1 = 0.9*0.8 - 0.6 + 0.9*0.2 = 0.3;
    # A0 = 0.9*0.6 - 0.5 + 0.9*0.3 = 0.31; R = [0.81, 0.9, 1.0] = 0.9^k discounted outcome
    adv, ret = gae(r, v, m, gamma=0.9, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([0.31, 0.3, 0.2])
    assert ret.tolist()[0] == pytest.approx([0.81, 0.9, 1.0])
    # a masked middle token is not a step: t0 bootstraps from V at t2:
    # A2 = 0.2; delta0 = 0.8 - 0.5 = 0.3, A0 = 0.3 + 0.5*0.2 = 0.4; R = [0.9, 0, 1.0]
    adv, ret = gae(r, torch.tensor([[0.5, 7.0, 0.8]]), torch.tensor([[1.0, 0.0, 1.0]]), 1.0, 0.5)
    assert adv.tolist()[0] == pytest.approx([0.4, 0.0, 0.2])
    assert ret.tolist()[0] == pytest.approx([0.9, 0.0, 1.0])


def test_value_clip_loss():
    v = torch.tensor([0.5, 1.0, 0.2])
    old = torch.tensor([0.2, 0.2, 0.2])
    ret = torch.tensor([1.0, 0.0, 1.0])
    # t0: (0.5-1)^2 = 0.25; V_clip = 0.2 + clip(0.3, +-0.2) = 0.4, (0.4-1)^2 = 0.36 -> 0.36, clipped
    # t1: (1-0)^2 = 1; V_clip = 0.4 -> 0.16 -> 1; t2: V = V_old -> 0.64 both, not clipped
    loss, clipped = value_clip_loss(v, old, ret, 0.2)
    assert loss.tolist() == pytest.approx([0.36, 1.0, 0.64])
    assert clipped.tolist() == [True, False, False]
    assert value_clip_loss(v, old, ret, None)[0].tolist() == pytest.approx([0.25, 1.0, 0.64])


def test_tis_weights_and_mismatch_mask():
    old = torch.zeros(3)
    rollout = torch.tensor([0.0, -1.0, 0.5])
    # exp(old - rollout) = [1, e = 2.71828, e^-0.5 = 0.6065307]; capped at 2
    assert tis_weights(old, rollout, 2.0).tolist() == pytest.approx([1.0, 2.0, 0.6065307])
    # band [0.7, 1.5]: only ratio 1 is inside
    assert mismatch_keep(old, rollout, 0.7, 1.5).tolist() == [1.0, 0.0, 0.0]


def test_sampled_entropy_value_and_gradient():
    lp = torch.tensor([-0.5, -2.0], requires_grad=True)
    old = torch.tensor([-0.5 - math.log(2.0), -2.0])
    # rho = exp(lp - old) = [2, 1]; value rho*(-lp) = [1.0, 2.0]; gradient -rho*lp = [1.0, 2.0]
    h = sampled_entropy(lp, old)
    assert h.tolist() == pytest.approx([1.0, 2.0])
    h.sum().backward()
    assert lp.grad.tolist() == pytest.approx([1.0, 2.0])


def test_sampled_entropy_is_unbiased_for_value_and_gradient():
    # Exact expectation over a 3-token categorical: sum_v p_v * estimate(v) must equal the
    # entropy, and the expected gradient must equal the entropy's gradient.
    logits = torch.tensor([0.3, -1.0, 1.2], requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    exact = -(logp.exp() * logp).sum()
    (g_exact,) = torch.autograd.grad(exact, logits, retain_graph=True)
    p = logp.exp().detach()
    est = (p * sampled_entropy(logp, logp.detach())).sum()
    (g_est,) = torch.autograd.grad(est, logits)
    assert est.item() == pytest.approx(exact.item(), rel=1e-6)
    torch.testing.assert_close(g_est, g_exact)


# --- GSPO ---------------------------------------------------------------------------------------

def test_sequence_log_ratio_is_length_normalised():
    lp = torch.tensor([[0.1, 0.3, 9.0], [-0.2, 0.0, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # row 0: (0.1 + 0.3)/2 = 0.2 (the padded 9 is ignored); row 1: -0.3/3 = -0.1
    out = sequence_log_ratio(lp, torch.zeros(2, 3), mask)
    assert out.tolist() == [pytest.approx([0.2] * 3), pytest.approx([-0.1] * 3)]


def test_gspo_loss_clips_whole_sequences():
    b = batch_of([2, 3], [1.0, -1.0])
    b.old_logprobs = torch.zeros(2, 3)
    lp = torch.tensor([[0.1, 0.3, 0.0], [-0.2, 0.0, -0.1]], requires_grad=True)
    algo = GSPO(GSPOConfig(clip_low=0.1, clip_high=0.15))
    loss, m = algo.loss(b, lp)
    # seq 0: s = e^0.2 = 1.2214028, A = +1: max(-1.2214, -clip(s, 0.9, 1.15) = -1.15) = -1.15 (clipped)
    # seq 1: s = e^-0.1 = 0.9048374, A = -1: inside [0.9, 1.15] -> 0.9048374 (not clipped)
    # seq-mean-token-mean: (-1.15 + 0.9048374)/2 = -0.1225813
    assert loss.item() == pytest.approx(-0.1225813, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(2 / 5)  # the 2 tokens of sequence 0
    loss.backward()
    # seq 0 clipped -> no gradient; seq 1: d(s)/d lp_t = s/3, over 2 sequences: 0.9048374/6
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.0, 0.0])
    assert lp.grad.tolist()[1] == pytest.approx([0.1508062] * 3, abs=1e-6)


def test_gspo_defaults_are_the_papers():
    c = GSPOConfig()
    assert (c.clip_low, c.clip_high_value, c.loss_agg) == (3e-4, 4e-4, "seq-mean-token-mean")
    with pytest.raises(ValidationError, match="clip_low must be in"):
        GSPOConfig(clip_low=0.0)  # grpo's validators still apply to the overridden default


# --- shared options in the policy loss ----------------------------------------------------------

def test_tis_and_mismatch_mask_in_policy_loss():
    # one sample, A = 1, current = old = -1 (ratio 1 -> per-token loss -1),
    # engine log-probs [-1, -2, -0.5] -> exp(old - rollout) = [1, e, e^-0.5]
    lp = torch.full((1, 3), -1.0, requires_grad=True)
    b = batch_of([3], [1.0], rollout_logprobs=[[-1.0, -2.0, -0.5]])
    loss, m = policy_loss(b, lp, GRPOConfig(tis_cap=2.0))
    # w = [1, 2, 0.6065307]; loss = -(1 + 2 + 0.6065307)/3 = -1.2021769
    assert loss.item() == pytest.approx(-1.2021769, abs=1e-6)
    assert m["tis_weight_mean"] == pytest.approx(1.2021769, abs=1e-6)
    assert m["tis_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-1 / 3, -2 / 3, -0.6065307 / 3], abs=1e-6)
    # band [0.7, 1.5] keeps only token 0: loss -1/3 (denominator stays 3 tokens)
    loss, m = policy_loss(b, lp, GRPOConfig(mismatch_mask_band=(0.7, 1.5)))
    assert loss.item() == pytest.approx(-1 / 3)
    assert m["mismatch_masked_frac"] == pytest.approx(2 / 3)
    loss, _ = policy_loss(b, lp, GRPOConfig(tis_cap=2.0, mismatch_mask_band=(0.7, 1.5)))
    assert loss.item() == pytest.approx(-1 / 3)


def test_mismatch_options_need_engine_logprobs():
    b = batch_of([2], [1.0])  # no Sample.logprobs
    with pytest.raises(ValueError, match="tis_cap"):
        policy_loss(b, torch.zeros(1, 2), GRPOConfig(tis_cap=2.0))


def test_entropy_bonus():
    b = batch_of([3], [0.0])  # A = 0: only the entropy term remains
    lp = torch.full((1, 3), -1.0, requires_grad=True)
    loss, m = policy_loss(b, lp, GRPOConfig(entropy_coef=0.1))
    # entropy estimate -lp = 1 per token, token-mean 1; loss = -0.1 * 1
    assert loss.item() == pytest.approx(-0.1)
    assert m["entropy"] == pytest.approx(1.0)
    loss.backward()
    # d/dlp of -0.1 * mean(surrogate) = -0.1 * (-lp)/3 = -0.1/3 per token
    assert lp.grad.tolist()[0] == pytest.approx([-0.1 / 3] * 3)
    # an exact entropy from the trainer takes precedence over the estimate
    b.extras["entropy"] = torch.tensor([[2.0, 2.0, 2.0]])
    assert policy_loss(b, lp, GRPOConfig(entropy_coef=0.1))[0].item() == pytest.approx(-0.2)


def test_grpo_kl_in_reward():
    b = batch_of([2], [0.5], rollout_logprobs=[[-1.0, -2.0]])
    b.ref_logprobs = torch.tensor([[-1.5, -1.0]])
    algo = GRPO(GRPOConfig(kl_reward_coef=0.1, kl_estimator="k1"))
    assert algo.needs_reference
    m = algo.prepare(b)
    # k1 with the engine's log-probs: kl = [-1 + 1.5, -2 + 1] = [0.5, -1];
    # A = 0.5 - 0.1 * kl = [0.45, 0.6]
    assert b.advantages.tolist()[0] == pytest.approx([0.45, 0.6])
    assert m["kl_reward"] == pytest.approx(-0.25)
    assert GRPO(GRPOConfig()).prepare(b) == {}  # off by default: advantages untouched


# --- REINFORCE++ --------------------------------------------------------------------------------

def test_reinforce_pp_outcomes():
    groups = [make_group([1, 0, 0, 1]), make_group([1.0])]
    assert ReinforcePP(ReinforcePPConfig()).advantages(groups) == [[1, 0, 0, 1], [1.0]]
    # baseline: minus the group mean 0.5; a lone sample is its own mean -> 0
    base = ReinforcePP(ReinforcePPConfig(baseline=True)).advantages(groups)
    assert base == [pytest.approx([0.5, -0.5, -0.5, 0.5]), [0.0]]
    algo = ReinforcePP(ReinforcePPConfig(filter_zero_variance=True))
    assert algo.keep(make_group([1, 1])) is False and algo.keep(make_group([1, 0])) is True
    assert ReinforcePP(ReinforcePPConfig()).keep(make_group([1, 1])) is True


def test_reinforce_pp_whitened_returns_without_kl():
    b = batch_of([2, 1, 3], [1.0, 0.0, 1.0])
    algo = ReinforcePP(ReinforcePPConfig(kl_reward_coef=0.0))
    assert not algo.needs_reference
    algo.prepare(b)
    # gamma 1: every token's return is its outcome -> five 1s and one 0; mean 5/6,
    # unbiased var = (5*(1/6)^2 + (5/6)^2)/5 = 1/6, std 0.4082483:
    # 1 -> (1/6)/0.4082483 = 0.4082483, 0 -> -(5/6)/0.4082483 = -2.0412414
    hi, lo = 0.4082483, -2.0412414
    assert b.advantages.tolist()[0] == pytest.approx([hi, hi, 0.0], abs=1e-6)
    assert b.advantages.tolist()[1] == pytest.approx([lo, 0.0, 0.0], abs=1e-6)
    assert b.advantages.tolist()[2] == pytest.approx([hi, hi, hi], abs=1e-6)


def test_reinforce_pp_kl_in_reward_and_discount():
    b = batch_of([3], [1.0], rollout_logprobs=[[-1.0, -1.0, -1.0]])
    b.ref_logprobs = torch.tensor([[-1.2, -0.8, -1.0]])
    algo = ReinforcePP(ReinforcePPConfig(kl_reward_coef=0.1, gamma=0.5))
    m = algo.prepare(b)
    # k1 kl = [0.2, -0.2, 0]; token rewards = [-0.02, 0.02, 1]; gamma 0.5:
    # G2 = 1, G1 = 0.02 + 0.5 = 0.52, G0 = -0.02 + 0.26 = 0.24; mean 0.5866667
    # deviations [-0.3466667, -0.0666667, 0.4133333], unbiased var 0.1477333, std 0.3843609
    assert m["return_mean"] == pytest.approx(0.5866667, abs=1e-6)
    assert m["kl_reward"] == pytest.approx(0.0, abs=1e-7)
    assert b.advantages.tolist()[0] == pytest.approx([-0.9019300, -0.1734481, 1.0753780], abs=1e-5)


def test_reinforce_pp_baseline_kl_per_token():
    b = batch_of([2, 1], [0.5, -0.5], rollout_logprobs=[[-1.0, -1.0], [-1.0]])
    b.ref_logprobs = torch.tensor([[-1.2, -1.0], [-0.5, 0.0]])
    algo = ReinforcePP(ReinforcePPConfig(baseline=True, kl_reward_coef=0.1))
    algo.prepare(b)
    # kl = [0.2, 0 | -0.5]; A = [0.5 - 0.02, 0.5, -0.5 + 0.05] = [0.48, 0.5, -0.45] (no
    # accumulation over tokens); mean 0.1766667, unbiased std 0.5428010
    assert b.advantages.tolist()[0] == pytest.approx([0.5588293, 0.5956752], abs=1e-5)
    assert b.advantages.tolist()[1] == pytest.approx([-1.1545045, 0.0], abs=1e-5)


@pytest.mark.parametrize("algo", [
    GSPO(GSPOConfig(clip_low=0.05, clip_high=0.1, entropy_coef=0.01, tis_cap=1.5)),
    GRPO(GRPOConfig(kl_coef=0.05, entropy_coef=0.01, tis_cap=1.5, mismatch_mask_band=(0.5, 2.0)))])
def test_micro_batches_sum_to_whole_with_all_options(algo):
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2]
    b = batch_of(lengths, [0.0] * 4, rollout_logprobs=[(-torch.rand(n, generator=g)).tolist() for n in lengths])
    b.advantages = torch.randn(4, 5, generator=g) * b.loss_mask
    b.old_logprobs = -torch.rand(4, 5, generator=g)
    b.ref_logprobs = -torch.rand(4, 5, generator=g)
    base = -torch.rand(4, 5, generator=g)
    whole_lp = base.clone().requires_grad_(True)
    whole, _ = algo.loss(b, whole_lp)
    whole.backward()
    micro_lp = base.clone().requires_grad_(True)
    total = sum(algo.loss(mb, micro_lp[i:i + 1])[0] for i, mb in enumerate(b.split(1)))
    total.backward()
    assert total.item() == pytest.approx(whole.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(micro_lp.grad, whole_lp.grad)


# --- config and wiring --------------------------------------------------------------------------

def test_shared_option_validation():
    with pytest.raises(ValidationError, match="mismatch_mask_band"):
        GRPOConfig(mismatch_mask_band=(1.2, 2.0))
    with pytest.raises(ValidationError, match="tis_cap"):
        GRPOConfig(tis_cap=0.0)
    with pytest.raises(ValidationError, match="gamma"):
        ReinforcePPConfig(gamma=1.5)
    for model in (GSPOConfig, ReinforcePPConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


@pytest.mark.parametrize("name", ["gspo", "reinforce_pp"])
def test_registered_lazily(name):
    assert_lazy_registration("miles_plugin_grpo", "algorithms", name)


def test_registered_through_entry_point():
    pm = miles.make_plugin_manager(autoload=True, allow=["grpo"])
    gspo = pm.create("algorithms", "gspo", GSPOConfig())
    rpp = pm.create("algorithms", "reinforce_pp", ReinforcePPConfig(baseline=True))
    assert isinstance(gspo, GSPO) and isinstance(gspo, Algorithm) and gspo.sequence_level
    assert isinstance(rpp, ReinforcePP) and isinstance(rpp, Algorithm) and rpp.needs_reference
