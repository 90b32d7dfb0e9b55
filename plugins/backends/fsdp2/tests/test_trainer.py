import pytest
import torch

from miles import Batch, Sample, Task
from miles.testing import TinySpec, char_tokenizer
from miles_plugin_fsdp2.config import FSDP2Config
from miles_fastpath.schedule import lr_lambda as _lr_lambda
from miles_plugin_fsdp2.trainer import FSDP2Trainer


def _batch(n=6):
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        p = torch.randint(3, 20, (2 + i % 3,), generator=g).tolist()
        r = torch.randint(3, 20, (1 + i % 4,), generator=g).tolist()
        samples.append(Sample(Task("x"), prompt_ids=p, response_ids=r, logprobs=[-1.0] * len(r)))
    return Batch.from_samples(samples, pad_id=0, advantages=[float(i % 3) - 1 for i in range(n)])


def _loss(batch, logprobs):
    return batch.token_mean(-batch.advantages * logprobs), {"m": 1.0}


def _trainer(**kw):
    tok = char_tokenizer()
    return FSDP2Trainer(FSDP2Config(**kw), spec=TinySpec(), tokenizer=tok, seed=0, total_steps=10)


def test_micro_batches_give_the_same_update_as_one_batch():
    whole, micro = _trainer(grad_clip=None), _trainer(grad_clip=None, micro_batch_size=2)
    b = _batch()
    whole.train_step(b, _loss)
    m = micro.train_step(b, _loss)
    assert m["m"] == pytest.approx(1.0)
    for (n, a), (_, c) in zip(whole.named_weights(), micro.named_weights()):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=n)


def test_logprobs_match_a_full_forward_and_temperature():
    t, b = _trainer(), _batch()
    b.temperature = 0.7
    lp = t.logprobs(b)
    logits = t.model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    full = torch.log_softmax(logits.float() / 0.7, -1)[:, b.prompt_len - 1:-1]
    want = full.gather(-1, b.input_ids[:, b.prompt_len:, None]).squeeze(-1)
    torch.testing.assert_close(lp * b.loss_mask, want.detach() * b.loss_mask, rtol=0, atol=1e-5)


def test_grad_clip_and_lr_schedule():
    t = _trainer(grad_clip=1e-6, lr=1e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    m = t.train_step(_batch(), _loss)
    assert m["grad_norm"] > 1e-6 and m["lr"] == pytest.approx(5e-4)  # first warm-up step: lr/2
    f = _lr_lambda(FSDP2Config(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1), total=10)
    assert [round(f(s), 4) for s in (0, 1, 2, 10)] == [0.5, 1.0, 1.0, 0.1]
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay


def test_save_load_roundtrip_continues_identically(tmp_path):
    a = _trainer()
    a.snapshot_reference()
    a.train_step(_batch(), _loss)
    a.save(str(tmp_path))
    b = _trainer()
    b.load(str(tmp_path))
    assert b.ref is not None
    a.train_step(_batch(), _loss)
    b.train_step(_batch(), _loss)
    for (n, x), (_, y) in zip(a.named_weights(), b.named_weights()):
        assert torch.equal(x, y), n


def test_reference_is_frozen_and_separate():
    t, b = _trainer(), _batch()
    t.snapshot_reference()
    before = t.logprobs(b, "ref")
    t.train_step(b, _loss)
    assert torch.equal(t.logprobs(b, "ref"), before)
    assert not torch.equal(t.logprobs(b), before)


def _grouped_batch(n=4, groups=3):
    g = torch.Generator().manual_seed(1)
    samples = []
    for k in range(groups):
        p = torch.randint(3, 20, (2 + k,), generator=g).tolist()
        for i in range(n):
            r = torch.randint(3, 20, (1 + (i + k) % 4,), generator=g).tolist()
            samples.append(Sample(Task("x"), prompt_ids=p, response_ids=r, logprobs=[-1.0] * len(r)))
    return Batch.from_samples(samples, pad_id=0, advantages=[float(i % 3) - 1 for i in range(n * groups)])


def test_shared_prompt_forward_equals_full_forward_with_gradients():
    from miles_plugin_fsdp2.trainer import _full_logits, _group_size, response_logprobs

    t, b = _trainer(), _grouped_batch()
    assert _group_size(b) == 4 and _group_size(_batch()) == 1
    lp = response_logprobs(t.model, b)
    full = torch.log_softmax(_full_logits(t.model, b), -1).gather(-1, b.input_ids[:, b.prompt_len:, None])[..., 0]
    torch.testing.assert_close(lp * b.loss_mask, full * b.loss_mask, rtol=0, atol=2e-5)
    g1 = torch.autograd.grad(b.token_mean(lp), list(t.model.parameters()), allow_unused=True)
    g2 = torch.autograd.grad(b.token_mean(full), list(t.model.parameters()), allow_unused=True)
    for a, c in zip(g1, g2):
        if a is not None:
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)


def test_registration_is_lazy():
    from miles.testing import assert_lazy_registration

    assert_lazy_registration("miles_plugin_fsdp2", "trainers", "fsdp2")


def test_cpu_gemm_choice_reaches_every_forward(monkeypatch):
    """trainer.cpu_gemm: auto is oneDNN on AMD CPUs only, for layers of ONEDNN_MIN_LAYER weights; the
    choice is what train_step, logprobs and the true on-policy scorer run; oneDNN where torch has
    none is an error naming the key."""
    from miles import MilesError
    from miles_fastpath import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "GenuineIntel")
    assert _trainer().gemm == "mkl"
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "AuthenticAMD")
    assert _trainer().gemm == "mkl"  # TinySpec's layers are small
    monkeypatch.setattr(cpu_gemm, "ONEDNN_MIN_LAYER", 1)
    assert _trainer().gemm == ("onednn" if cpu_gemm.onednn_available() else "mkl")
    if cpu_gemm.onednn_available():
        calls, real = [], cpu_gemm.trainable_linear
        monkeypatch.setattr(cpu_gemm, "trainable_linear", lambda *a: calls.append(1) or real(*a))
        for workers in (1, 2):
            t, b = _trainer(cpu_gemm="onednn", cpu_workers=workers), _batch()
            t.train_step(b, _loss)
            n = len(calls)
            lp = t.logprobs(b)
            assert n > 0 and len(calls) > n
            torch.testing.assert_close(t.response_logprobs(t.model, b), lp, rtol=0, atol=0)
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)
    with pytest.raises(MilesError, match="trainer.cpu_gemm=onednn"):
        _trainer(cpu_gemm="onednn")
