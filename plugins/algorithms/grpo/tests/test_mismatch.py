"""IcePop and sequence-level MIS / RS in the policy loss, against hand-computed numbers.

Setup of every case: advantage 1, current = old log-prob = -1 (PPO ratio 1, per-token loss -1);
sample 0's engine log-probs [-1, -2, -0.5] give trainer/rollout ratios exp(old - rollout) =
[1, e, e^-0.5] = [1, 2.7182818, 0.6065307]; sample 1 (two tokens) agrees with the trainer (ratio 1).
token-mean divides by all 5 trainable tokens. Digits from a calculator, not the code under test.
"""
import miles
import pytest
import torch
from miles_plugin_grpo.config import GRPOConfig, GSPOConfig
from miles_rlmath import icepop_weights, policy_loss, sequence_ratio
from pydantic import ValidationError


def two_samples():
    task = miles.Task(prompt="p")
    samples = [miles.Sample(task=task, prompt_ids=[1, 2], response_ids=[3, 4, 5], logprobs=[-1.0, -2.0, -0.5]),
               miles.Sample(task=task, prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-1.0, -1.0])]
    return miles.Batch.from_samples(samples, pad_id=0, advantages=[1.0, 1.0])


def logprobs():
    return torch.full((2, 3), -1.0, requires_grad=True)


def test_icepop_weights_keep_the_ratio_inside_the_band():
    old = torch.tensor([-1.0, -1.0, -1.0])
    rollout = torch.tensor([-1.0, -2.0, -0.5])
    assert icepop_weights(old, rollout, 0.5, 2.0).tolist() == pytest.approx([1.0, 0.0, 0.6065307])
    assert icepop_weights(old, rollout, 0.7, 3.0).tolist() == pytest.approx([1.0, 2.7182818, 0.0])


def test_icepop_in_policy_loss():
    b, lp = two_samples(), logprobs()
    loss, m = policy_loss(b, lp, GRPOConfig(icepop=(0.5, 2.0)))
    # factors [1, 0, 0.6065307 | 1, 1]: loss -(1 + 0.6065307 + 2) / 5 = -0.7213061
    assert loss.item() == pytest.approx(-0.7213061, abs=1e-6)
    assert m["icepop_masked_frac"] == pytest.approx(1 / 5)
    assert m["icepop_weight_mean"] == pytest.approx(0.7213061, abs=1e-6)
    assert m["correction_masked_frac"] == pytest.approx(1 / 5)
    # token ratios over the 5 trainable tokens: mean (1 + e + e^-0.5 + 2) / 5 = 1.2649625
    assert m["mismatch_ratio_mean"] == pytest.approx(1.2649625, abs=1e-6)
    assert (m["mismatch_ratio_min"], m["mismatch_ratio_max"]) == pytest.approx((0.6065307, 2.7182818))
    loss.backward()
    # d loss / d logp_t = -factor_t / 5; the masked token gets nothing
    assert lp.grad.flatten().tolist() == pytest.approx([-0.2, 0.0, -0.6065307 / 5, -0.2, -0.2, 0.0], abs=1e-6)


def test_sequence_ratio_geometric_and_product():
    old = torch.full((2, 3), -1.0)
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # sample 0: log ratios 0, 1, -0.5 -> mean 1/6 -> e^(1/6) = 1.1813604; sum 0.5 -> e^0.5 = 1.6487213
    assert sequence_ratio(old, rollout, mask, "geometric").tolist() == pytest.approx([1.1813604, 1.0])
    assert sequence_ratio(old, rollout, mask, "product").tolist() == pytest.approx([1.6487213, 1.0])


@pytest.mark.parametrize("cfg, expected, rejected", [
    # MIS geometric, band [0.5, 2]: sample 0 weighted 1.1813604 -> -(3 * 1.1813604 + 2) / 5
    (dict(seq_correction="mis"), -1.1088162, 0.0),
    # MIS product: sample 0 weighted 1.6487213 -> -(3 * 1.6487213 + 2) / 5
    (dict(seq_correction="mis", seq_ratio="product"), -1.3892328, 0.0),
    # product 1.6487 leaves [0.5, 1.5]: sample 0 dropped -> -2 / 5
    (dict(seq_correction="mis", seq_ratio="product", seq_band=(0.5, 1.5)), -0.4, 0.5),
    # RS keeps without weight: -5 / 5
    (dict(seq_correction="rs"), -1.0, 0.0),
    # RS band [0.5, 1.1]: geometric 1.18 rejected -> -2 / 5
    (dict(seq_correction="rs", seq_band=(0.5, 1.1)), -0.4, 0.5),
    # the veto: sample 0's token ratio 0.6065 < 0.7 drops it although its mean is in the band
    (dict(seq_correction="rs", seq_veto=0.7), -0.4, 0.5),
])
def test_sequence_corrections_in_policy_loss(cfg, expected, rejected):
    b, lp = two_samples(), logprobs()
    loss, m = policy_loss(b, lp, GRPOConfig(**cfg))
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["seq_rejected_frac"] == pytest.approx(rejected)
    assert m["seq_masked_token_frac"] == pytest.approx(3 / 5 if rejected else 0.0)
    ratio = 1.6487213 if cfg.get("seq_ratio") == "product" else 1.1813604
    assert (m["seq_ratio_min"], m["seq_ratio_max"]) == pytest.approx((1.0, ratio))
    loss.backward()
    assert lp.grad[1].tolist() == pytest.approx([-0.2, -0.2, 0.0])  # the agreeing sample, untouched


def test_sequence_correction_with_gspo():
    # GSPO's sequence ratio is 1 here too (current = old), so the loss is the same as GRPO's
    b = two_samples()
    loss, m = policy_loss(b, logprobs(), GSPOConfig(seq_correction="rs", seq_band=(0.5, 1.1)),
                          sequence_level=True)
    # seq-mean-token-mean: sample 0 dropped (0), sample 1 mean -1 -> (0 - 1) / 2
    assert loss.item() == pytest.approx(-0.5)
    assert m["seq_rejected_frac"] == pytest.approx(0.5)


def test_options_that_weight_twice_are_refused():
    with pytest.raises(ValidationError, match="tis_cap and icepop"):
        GRPOConfig(tis_cap=2.0, icepop=(0.5, 5.0))
    with pytest.raises(ValidationError, match="icepop and seq_correction: mis"):
        GRPOConfig(icepop=(0.5, 5.0), seq_correction="mis")
    with pytest.raises(ValidationError, match="seq_band must be"):
        GRPOConfig(seq_correction="rs", seq_band=(1.2, 2.0))
    GRPOConfig(tis_cap=2.0, seq_correction="rs", mismatch_mask_band=(0.5, 2.0))  # masks combine


def test_corrections_need_engine_logprobs():
    task = miles.Task(prompt="p")
    b = miles.Batch.from_samples([miles.Sample(task=task, prompt_ids=[1], response_ids=[2, 3])], pad_id=0,
                                 advantages=[1.0])
    with pytest.raises(ValueError, match="icepop"):
        policy_loss(b, torch.zeros(1, 2), GRPOConfig(icepop=(0.5, 5.0)))
