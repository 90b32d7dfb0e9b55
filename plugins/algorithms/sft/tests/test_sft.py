"""SFT plugin tests. Every expected number is worked out by hand in the comments."""

import miles
import pytest
import torch
from miles.protocols import Algorithm
from miles.testing import assert_lazy_registration, make_group
from miles_plugin_sft.algorithm import SFT
from miles_plugin_sft.config import SFTConfig
from pydantic import ValidationError


def demo_batch():
    """Two demonstrations: 2 target tokens, and 4 target tokens of which token 1 is masked."""
    task = miles.Task(prompt="p")
    samples = [miles.Sample(task=task, prompt_ids=[1], response_ids=[5, 6]),
               miles.Sample(task=task, prompt_ids=[1, 2], response_ids=[5, 6, 7, 8], loss_mask=[1, 0, 1, 1])]
    return miles.Batch.from_samples(samples, pad_id=0)


# row 0: logprobs [-1, -2] (+ padding); row 1: [-3, -99 (masked), -3, -3]
LOGPROBS = [[-1.0, -2.0, -50.0, -50.0], [-3.0, -99.0, -3.0, -3.0]]


def test_token_mean_nll():
    lp = torch.tensor(LOGPROBS, requires_grad=True)
    loss, m = SFT(SFTConfig()).loss(demo_batch(), lp)
    # (1 + 2 + 3 + 3 + 3) / 5 trainable tokens = 12/5
    assert loss.item() == pytest.approx(2.4)
    assert m == {"sft_loss": pytest.approx(2.4)}
    loss.backward()
    # d/dlp of -sum(mask*lp)/5 = -mask/5
    assert lp.grad.tolist() == [pytest.approx([-0.2, -0.2, 0, 0]), pytest.approx([-0.2, 0, -0.2, -0.2])]


def test_seq_mean_nll():
    loss, m = SFT(SFTConfig(loss_agg="seq-mean-token-mean")).loss(demo_batch(), torch.tensor(LOGPROBS))
    # ((1+2)/2 + (3+3+3)/3) / 2 = (1.5 + 3) / 2 = 2.25
    assert loss.item() == pytest.approx(2.25)
    assert m["sft_loss"] == pytest.approx(2.25)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_sum_to_whole(loss_agg):
    algo = SFT(SFTConfig(loss_agg=loss_agg))
    b = demo_batch()
    whole_lp = torch.tensor(LOGPROBS, requires_grad=True)
    whole, _ = algo.loss(b, whole_lp)
    whole.backward()
    micro_lp = torch.tensor(LOGPROBS, requires_grad=True)
    parts = [algo.loss(mb, micro_lp[i:i + 1]) for i, mb in enumerate(b.split(1))]
    total = sum(p[0] for p in parts)
    total.backward()
    assert total.item() == pytest.approx(whole.item())
    torch.testing.assert_close(micro_lp.grad, whole_lp.grad)
    # token-mean shares: row 0 = 3/5 = 0.6, row 1 = 9/5 = 1.8 (sum 2.4)
    # seq-mean shares:   row 0 = 1.5/2 = 0.75, row 1 = 3/2 = 1.5 (sum 2.25)
    expected = [0.6, 1.8] if loss_agg == "token-mean" else [0.75, 1.5]
    assert [p[0].item() for p in parts] == pytest.approx(expected)
    # the metric is each micro-batch's own mean NLL: row 0 = 1.5, row 1 = 3
    assert [p[1]["sft_loss"] for p in parts] == pytest.approx([1.5, 3.0])


def test_protocol_members():
    algo = SFT()
    assert algo.uses_rollout is False and algo.needs_reference is False
    assert algo.keep(make_group([1, 1, 1])) is True
    assert algo.advantages([make_group([1, 0]), make_group([3.0])]) == [[0.0, 0.0], [0.0]]
    assert isinstance(algo, Algorithm)


def test_config():
    assert SFTConfig().loss_agg == "token-mean"
    with pytest.raises(ValidationError, match="loss_agg"):
        SFTConfig(loss_agg="sum")
    with pytest.raises(ValidationError, match="kl_coef"):
        SFTConfig(kl_coef=0.1)  # extra="forbid"
    for name, field in SFTConfig.model_fields.items():
        assert field.description, f"{name} has no description"


def test_import_does_not_pull_torch():
    assert_lazy_registration("miles_plugin_sft", "algorithms", "sft")


def test_registered_through_entry_point():
    pm = miles.make_plugin_manager(autoload=True, allow=["sft"])
    assert pm.registry("algorithms")["sft"].config is SFTConfig
    algo = pm.create("algorithms", "sft", SFTConfig(loss_agg="seq-mean-token-mean"))
    assert isinstance(algo, SFT) and algo.cfg.loss_agg == "seq-mean-token-mean"
