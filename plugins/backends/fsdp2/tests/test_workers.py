import pytest
import torch

from miles import Batch, Sample, Task
from miles.testing import TinySpec, char_tokenizer
from miles_plugin_fsdp2.config import FSDP2Config
from miles_plugin_fsdp2.trainer import FSDP2Trainer
from miles_plugin_fsdp2.workers import chunks


def _batch(groups=(4, 4, 3, 1)):
    g = torch.Generator().manual_seed(2)
    samples = []
    for k, n in enumerate(groups):
        p = torch.randint(3, 20, (2 + k % 3,), generator=g).tolist()
        for i in range(n):
            r = torch.randint(3, 20, (1 + (i + k) % 5,), generator=g).tolist()
            samples.append(Sample(Task("x"), prompt_ids=p, response_ids=r, logprobs=[-1.0] * len(r)))
    return Batch.from_samples(samples, pad_id=0, advantages=[float(i % 3) - 1 for i in range(len(samples))])


def _loss(batch, logprobs):
    return batch.token_mean(-batch.advantages * logprobs), {"lp": float(logprobs.detach().sum())}


def _trainer(**kw):
    return FSDP2Trainer(FSDP2Config(grad_clip=None, **kw), spec=TinySpec(), tokenizer=char_tokenizer(),
                        seed=0, total_steps=10)


def test_chunks_cut_between_prompt_runs_and_balance_rows():
    assert chunks([8, 8, 8, 8], 2) == [(0, 16), (16, 32)]
    assert chunks([4, 4, 2, 2], 2) in ([(0, 4), (4, 12)], [(0, 8), (8, 12)])  # a tie
    assert chunks([4, 4, 3, 1], 3) == [(0, 4), (4, 8), (8, 12)]
    assert chunks([8, 8, 8], 2) in ([(0, 8), (8, 24)], [(0, 16), (16, 24)])
    assert chunks([12], 2) == [(0, 6), (6, 12)]  # one prompt: cut inside the run
    assert chunks([1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3)]  # never an empty chunk
    assert chunks([5, 5], 1) == [(0, 10)]


@pytest.mark.parametrize("micro", [None, 5])
def test_workers_give_the_update_and_metrics_of_one_thread(micro):
    one, two = _trainer(cpu_workers=1, micro_batch_size=micro), _trainer(cpu_workers=2, micro_batch_size=micro)
    assert one.workers is None and two.workers.k == 2
    b = _batch()
    lp = two.logprobs(b)
    assert not lp.requires_grad  # the workers ran it without a graph, as the caller asked
    torch.testing.assert_close(lp, one.logprobs(b), rtol=0, atol=1e-6)
    for _ in range(2):
        m1, m2 = one.train_step(b, _loss), two.train_step(b, _loss)
        assert m2["lp"] == pytest.approx(m1["lp"], rel=1e-5)
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4)
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    for (n, a), (_, c) in zip(one.named_weights(), two.named_weights()):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=n)


def test_workers_steps_are_deterministic():
    a, b = _trainer(cpu_workers=2), _trainer(cpu_workers=2)
    for t in (a, b):
        t.train_step(_batch(), _loss)
    for (n, x), (_, y) in zip(a.named_weights(), b.named_weights()):
        assert torch.equal(x, y), n


def test_workers_leave_the_callers_thread_count_alone():
    prev = torch.get_num_threads()
    _trainer(cpu_workers=3).train_step(_batch(), _loss)
    assert torch.get_num_threads() == prev


def test_the_routine_engines_score_with_gives_the_training_logprobs_bit_for_bit():
    t, b = _trainer(cpu_workers=2), _batch()
    seen = []

    def loss(batch, logprobs):
        seen.append(logprobs.detach().clone())
        return _loss(batch, logprobs)

    want = t.response_logprobs(t.model, b)  # true on-policy: the engine calls this on its weights
    t.train_step(b, loss)
    assert torch.equal(seen[0], want)
