"""The critic the fsdp2 trainer builds for algorithms with ``needs_critic`` (PPO)."""
from types import SimpleNamespace

import pytest
import torch

from miles import Batch, Sample, Task
from miles.testing import TinySpec, char_tokenizer
from miles_plugin_fsdp2 import _make
from miles_plugin_fsdp2.config import FSDP2Config
from miles_plugin_fsdp2.critic import CriticTrainer
from miles_plugin_fsdp2.trainer import FSDP2Trainer

def _batch(responses=((5, 6, 7), (8, 9), (10,))):
    samples = [Sample(Task("x"), prompt_ids=[3, 4], response_ids=list(r), logprobs=[-1.0] * len(r))
               for r in responses]
    return Batch.from_samples(samples, pad_id=0, advantages=[0.0] * len(samples))


def _mse_to(target):
    def loss_fn(batch, values):
        err = (values - target) ** 2
        return batch.token_mean(err), {"mse": float(batch.as_global().token_mean(err.detach()))}
    return loss_fn


ALGO = SimpleNamespace(needs_critic=True, critic_lr=3e-3, value_loss=_mse_to(0.0))  # a CriticAlgorithm


def _trainer(algorithm=ALGO, **kw):
    return _make(FSDP2Config(**kw), spec=TinySpec(), tokenizer=char_tokenizer(), seed=0,
                 total_steps=10, algorithm=algorithm)


def test_factory_builds_a_critic_only_when_asked():
    assert isinstance(_trainer(), CriticTrainer)
    plain = _trainer(algorithm=SimpleNamespace(needs_critic=False))
    assert type(plain) is FSDP2Trainer and not hasattr(plain, "values")


def test_values_start_at_zero_and_come_from_the_policy_backbone():
    t = _trainer()
    b = _batch()
    v = t.values(b)
    assert v.shape == b.loss_mask.shape and torch.count_nonzero(v) == 0  # zero-initialised head
    policy = dict(t.named_weights())
    for name, w in t.critic.backbone.state_dict().items():
        torch.testing.assert_close(w, policy[f"model.{name}"], msg=name)
    assert t.critic_optim.param_groups[0]["lr"] == 3e-3


def test_value_at_t_sees_only_the_tokens_before_t():
    t = _trainer()
    t.train_critic(_batch(), _mse_to(1.0))  # a non-zero head, so values depend on the input
    a = t.values(_batch(((5, 6, 7),)))
    b = t.values(_batch(((5, 6, 11),)))  # only the last response token differs
    # V_0..V_2 are the states before tokens 0..2: none has seen token 2 yet
    torch.testing.assert_close(a, b)
    c = t.values(_batch(((5, 12, 7),)))  # token 1 differs: V_0, V_1 equal, V_2 changes
    torch.testing.assert_close(a[:, :2], c[:, :2])
    assert not torch.allclose(a[:, 2], c[:, 2])


def test_critic_trains_and_leaves_the_policy_alone():
    t = _trainer(micro_batch_size=2)
    b = _batch()
    before = {k: v.clone() for k, v in t.named_weights()}
    first = t.train_critic(b, _mse_to(1.0))
    for _ in range(40):
        last = t.train_critic(b, _mse_to(1.0))
    assert first["mse"] == pytest.approx(1.0)  # values start at 0
    assert last["mse"] < 0.05 and last["critic_grad_norm"] > 0
    v = t.values(b)
    assert ((v - 1.0).abs() * b.loss_mask).max() < 0.3
    for k, w in t.named_weights():
        torch.testing.assert_close(w, before[k], msg=k)


def test_critic_is_saved_and_restored(tmp_path):
    t = _trainer()
    b = _batch()
    for _ in range(3):
        t.train_critic(b, _mse_to(0.5))
    t.save(str(tmp_path))
    assert (tmp_path / "critic.pt").is_file()
    u = _trainer()
    u.load(str(tmp_path))
    torch.testing.assert_close(u.values(b), t.values(b))
    # the optimizer state came along: the next step is identical too
    t.train_critic(b, _mse_to(0.5))
    u.train_critic(b, _mse_to(0.5))
    torch.testing.assert_close(u.values(b), t.values(b))


def test_checkpoint_without_critic_builds_it_from_the_loaded_policy(tmp_path):
    src = _trainer(algorithm=SimpleNamespace(needs_critic=False), lr=1e-2)
    src.train_step(_batch(), lambda batch, lp: (batch.token_mean(-lp), {}))
    src.save(str(tmp_path))
    t = _trainer()
    t.load(str(tmp_path))
    t.values(_batch())
    loaded = dict(src.named_weights())
    for name, w in t.critic.backbone.state_dict().items():
        torch.testing.assert_close(w, loaded[f"model.{name}"], msg=name)
