"""GRPO plugin tests. Every expected number is worked out by hand in the comments."""
import math

import miles
import pytest
import torch
from miles.protocols import Algorithm
from miles.testing import assert_lazy_registration, make_group
from miles_plugin_grpo.algorithm import GRPO
from miles_plugin_grpo.config import GRPOConfig
from miles_rlmath import aggregate, group_advantages, kl_estimate, ppo_clip_loss
from pydantic import ValidationError


def batch_of(lengths, advantages, masks=None, rewards=None):
    """A Batch with one sample per response length; ``advantages``/``masks`` per sample."""
    task = miles.Task(prompt="p")
    samples = []
    for i, n in enumerate(lengths):
        samples.append(miles.Sample(task=task, prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)),
                                    loss_mask=(masks[i] if masks else None),
                                    reward=(rewards[i] if rewards else 0.0)))
    return miles.Batch.from_samples(samples, pad_id=0, advantages=advantages)


# --- advantages ---------------------------------------------------------------------------------

def test_advantages_std_normalised():
    # [1,0,0,1]: mean 0.5, deviations ±0.5, unbiased var = 4*0.25/3 = 1/3, std = sqrt(1/3)
    s = math.sqrt(1 / 3) + 1e-6
    assert group_advantages([1, 0, 0, 1]) == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])
    assert 0.5 / s == pytest.approx(0.8660239, abs=1e-6)
    # [1,0,0,0]: mean 0.25, deviations [0.75,-0.25,-0.25,-0.25],
    # unbiased var = (0.5625 + 3*0.0625)/3 = 0.25, std = 0.5 -> 0.75/0.500001, -0.25/0.500001
    assert group_advantages([1, 0, 0, 0]) == pytest.approx(
        [0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001])


def test_advantages_without_std():
    assert group_advantages([1, 0, 0, 1], std_normalize=False) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert group_advantages([1, 0, 0, 0], std_normalize=False) == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_advantages_edge_cases():
    assert group_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]  # std 0: no division, deviations 0
    # n == 1: no baseline but itself (r - mean(r) = 0), std undefined -> 0 (miles_rlmath's rule)
    assert group_advantages([0.7]) == [0.0]
    assert group_advantages([0.7], std_normalize=False) == [0.0]
    algo = GRPO(GRPOConfig())
    out = algo.advantages([make_group([1, 0, 0, 0]), make_group([2.0])])
    assert out[0] == pytest.approx([1.499997, -0.499999, -0.499999, -0.499999], abs=1e-6)
    assert out[1] == [0.0]


def test_zero_variance_filter():
    algo = GRPO(GRPOConfig())
    assert algo.keep(make_group([1, 0, 1])) is True
    assert algo.keep(make_group([1, 1, 1])) is False
    assert algo.keep(make_group([0, 0])) is False
    assert algo.keep(make_group([1])) is True  # a single sample is kept
    assert GRPO(GRPOConfig(filter_zero_variance=False)).keep(make_group([1, 1, 1])) is True


# --- PPO clip -----------------------------------------------------------------------------------

RATIOS = torch.tensor([[1.5, 0.5, 1.1, 1.0], [1.5, 0.5, 1.1, 1.0]])


def test_ppo_clip_both_signs():
    lp, old = torch.log(RATIOS), torch.zeros(2, 4)
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4])
    loss, clipped = ppo_clip_loss(lp, old, adv, clip_low=0.2)
    # A=+1: L1 = -r = [-1.5,-0.5,-1.1,-1]; L2 = -clip(r,.8,1.2) = [-1.2,-0.8,-1.1,-1]
    #       max -> [-1.2,-0.5,-1.1,-1]; clipped only at token 0 (-1.2 > -1.5)
    # A=-1: L1 = r = [1.5,0.5,1.1,1]; L2 = [1.2,0.8,1.1,1]; max -> [1.5,0.8,1.1,1];
    #       clipped only at token 1 (0.8 > 0.5)
    assert loss.tolist() == [pytest.approx([-1.2, -0.5, -1.1, -1.0]), pytest.approx([1.5, 0.8, 1.1, 1.0])]
    assert clipped.tolist() == [[True, False, False, False], [False, True, False, False]]

    b = batch_of([4, 4], [[1.0] * 4, [-1.0] * 4])
    b.old_logprobs = old
    total, m = GRPO(GRPOConfig()).loss(b, lp)
    # token-mean: (-1.2-0.5-1.1-1.0 + 1.5+0.8+1.1+1.0) / 8 = 0.6 / 8 = 0.075
    assert total.item() == pytest.approx(0.075)
    assert m["pg_loss"] == pytest.approx(0.075)
    assert m["pg_clipfrac"] == pytest.approx(2 / 8)
    # ppo_kl = mean(old - lp) = -mean(log r) = -2*(ln1.5 + ln0.5 + ln1.1 + ln1)/8
    assert m["ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 4)
    assert "kl" not in m


def test_clip_higher_is_asymmetric():
    lp = torch.log(torch.tensor([[1.25, 0.75]]))
    adv = torch.tensor([[1.0, -1.0]])
    # symmetric eps=0.2: A=+1, r=1.25 -> max(-1.25, -1.2) = -1.2 (clipped);
    #                    A=-1, r=0.75 -> max(0.75, 0.8) = 0.8 (clipped)
    loss, clipped = ppo_clip_loss(lp, torch.zeros(1, 2), adv, 0.2)
    assert loss.tolist()[0] == pytest.approx([-1.2, 0.8])
    assert clipped.tolist() == [[True, True]]
    # clip_high=0.28: upper bound 1.28 > 1.25 -> -1.25 (not clipped); lower bound still 0.8
    loss, clipped = ppo_clip_loss(lp, torch.zeros(1, 2), adv, 0.2, clip_high=0.28)
    assert loss.tolist()[0] == pytest.approx([-1.25, 0.8])
    assert clipped.tolist() == [[False, True]]


def test_dual_clip():
    lp = torch.log(torch.tensor([[5.0, 2.0, 5.0]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    # A=-1, r=5: max(5, 1.2) = 5, capped at -c*A = 3 -> 3
    # A=-1, r=2: max(2, 1.2) = 2 < 3 -> 2
    # A=+1, r=5: max(-5, -1.2) = -1.2; the cap (-3) must NOT apply to positive A
    loss, _ = ppo_clip_loss(lp, torch.zeros(1, 3), adv, 0.2, dual_clip_c=3.0)
    assert loss.tolist()[0] == pytest.approx([3.0, 2.0, -1.2])
    loss, _ = ppo_clip_loss(lp, torch.zeros(1, 3), adv, 0.2)
    assert loss.tolist()[0] == pytest.approx([5.0, 2.0, -1.2])


def test_on_policy_without_old_logprobs_is_policy_gradient():
    b = batch_of([2], [[2.0, -1.0]])
    lp = torch.tensor([[-0.3, -0.7]], requires_grad=True)
    loss, m = GRPO(GRPOConfig()).loss(b, lp)
    # ratio = 1 -> L = -A = [-2, 1]; token-mean = -1/2; dL/dlp = -A * ratio / 2 = [-1, 0.5]
    assert loss.item() == pytest.approx(-0.5)
    loss.backward()
    assert lp.grad.tolist() == [pytest.approx([-1.0, 0.5])]
    assert m["pg_clipfrac"] == 0.0 and m["ppo_kl"] == 0.0


# --- KL -----------------------------------------------------------------------------------------

def test_kl_estimators():
    lp, ref = torch.tensor([0.5, -1.0]), torch.tensor([0.0, 0.0])
    # lr = [0.5, -1]
    assert kl_estimate(lp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    # lr^2/2 = [0.125, 0.5]
    assert kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    # exp(-lr) - 1 + lr: e^-0.5 - 0.5 = 0.60653066 - 0.5 = 0.10653066; e^1 - 2 = 0.71828183
    assert kl_estimate(lp, ref, "k3").tolist() == pytest.approx([0.10653066, 0.71828183])
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, "k4")


def test_kl_term_in_loss():
    b = batch_of([2], [[0.0, 0.0]])
    b.ref_logprobs = torch.zeros(1, 2)
    lp = torch.tensor([[0.5, -1.0]])
    algo = GRPO(GRPOConfig(kl_coef=0.1, kl_estimator="k2"))
    assert algo.needs_reference and not GRPO(GRPOConfig()).needs_reference
    loss, m = algo.loss(b, lp)
    # pg part is 0 (A = 0); k2 token-mean = (0.125 + 0.5)/2 = 0.3125; * 0.1 = 0.03125
    assert loss.item() == pytest.approx(0.03125)
    assert m["kl"] == pytest.approx(0.3125)
    b.ref_logprobs = None
    with pytest.raises(ValueError, match="ref_logprobs"):
        algo.loss(b, lp)


# --- aggregation --------------------------------------------------------------------------------

def test_aggregations_on_unequal_lengths():
    # sample 0: 2 tokens, A = [1, 2]; sample 1: 4 tokens, A = [3,3,100,3], token 2 masked out
    b = batch_of([2, 4], [[1.0, 2.0], [3.0, 3.0, 100.0, 3.0]], masks=[[1, 1], [1, 1, 0, 1]])
    lp = torch.zeros(2, 4)  # ratio 1 -> per-token loss = -A

    def run(**kw):
        return float(GRPO(GRPOConfig(**kw)).loss(b, lp)[0])
    # token-mean: -(1+2 + 3+3+3) / 5 = -12/5
    assert run() == pytest.approx(-2.4)
    # seq-mean-token-mean: -((1+2)/2 + 9/3) / 2 = -(1.5+3)/2
    assert run(loss_agg="seq-mean-token-mean") == pytest.approx(-2.25)
    # Dr.GRPO: -((1+2) + 9) / 4 / 2 = -12/8
    assert run(loss_agg="seq-mean-token-sum-norm", max_response_len=4) == pytest.approx(-1.5)
    assert run(dr_grpo=True, max_response_len=4) == pytest.approx(-1.5)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_micro_batches_sum_to_whole(loss_agg, size):
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2, 4]
    b = batch_of(lengths, [0.0] * 5,
                 masks=[[1] * n for n in lengths[:2]] + [[1, 0, 1, 1, 1], [1, 1], [0, 1, 1, 1]])
    b.advantages = torch.randn(5, 5, generator=g)  # per-token advantages
    b.old_logprobs = -torch.rand(5, 5, generator=g)
    b.ref_logprobs = -torch.rand(5, 5, generator=g)
    base = -torch.rand(5, 5, generator=g)
    algo = GRPO(GRPOConfig(loss_agg=loss_agg, kl_coef=0.05, clip_high=0.28, dual_clip_c=3.0,
                           max_response_len=6))

    whole_lp = base.clone().requires_grad_(True)
    whole, _ = algo.loss(b, whole_lp)
    whole.backward()

    micro_lp = base.clone().requires_grad_(True)
    parts, start = [], 0
    for mb in b.split(size):
        parts.append(algo.loss(mb, micro_lp[start:start + len(mb)])[0])
        start += len(mb)
    total = sum(parts)
    total.backward()
    assert total.item() == pytest.approx(whole.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(micro_lp.grad, whole_lp.grad)


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(batch_of([1], [0.0]), torch.zeros(1, 1), "sum")


# --- config -------------------------------------------------------------------------------------

def test_config_validation():
    with pytest.raises(ValidationError, match="clip_high"):
        GRPOConfig(clip_low=0.3, clip_high=0.2)
    with pytest.raises(ValidationError, match="clip_low must be in"):
        GRPOConfig(clip_low=1.0)
    with pytest.raises(ValidationError, match="dual_clip_c must be > 1"):
        GRPOConfig(dual_clip_c=1.0)
    with pytest.raises(ValidationError, match="entropy_bonus"):
        GRPOConfig(entropy_bonus=0.01)  # extra="forbid"
    with pytest.raises(ValidationError, match="std_normalize"):
        GRPOConfig(dr_grpo=True, std_normalize=True)
    with pytest.raises(ValidationError, match="loss_agg"):
        GRPOConfig(dr_grpo=True, loss_agg="token-mean")


def test_config_defaults_and_presets():
    c = GRPOConfig()
    assert c.clip_high is None and c.clip_high_value == 0.2
    assert GRPOConfig(clip_high=0.28).clip_high_value == 0.28
    d = GRPOConfig(dr_grpo=True)
    assert d.std_normalize is False and d.loss_agg == "seq-mean-token-sum-norm"
    for name, field in GRPOConfig.model_fields.items():
        assert field.description, f"{name} has no description"


# --- plugin wiring ------------------------------------------------------------------------------

def test_import_does_not_pull_torch():
    assert_lazy_registration("miles_plugin_grpo", "algorithms", "grpo")


def test_registered_through_entry_point():
    pm = miles.make_plugin_manager(autoload=True, allow=["grpo"])
    comp = pm.registry("algorithms")["grpo"]
    assert comp.config is GRPOConfig
    algo = pm.create("algorithms", "grpo", GRPOConfig(kl_coef=0.1))
    assert isinstance(algo, GRPO) and isinstance(algo, Algorithm)
    assert algo.uses_rollout and algo.needs_reference
