"""The draft head's online training: it learns the policy's next-next-token distribution and
leaves no gradient on the policy."""
import pytest
import torch
from miles import Batch, Sample, Task
from pydantic import ValidationError
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles_draft.config import DraftConfig
from miles_draft.head import head_of
from miles_draft.train import DraftTraining


def _batch(rows: int = 16) -> Batch:
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(rows):  # a pattern two tokens ahead is predictable: x, x+1, x+2, ...
        start = int(torch.randint(1, 8, (1,), generator=g))
        seq = [(start + i) % 16 for i in range(10)]
        samples.append(Sample(task=Task(prompt=""), prompt_ids=seq[:3], response_ids=seq[3:], loss_mask=[1] * 7))
    return Batch.from_samples(samples, 0)


def test_the_head_learns_and_the_policy_gets_no_gradient():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
                                         max_position_embeddings=32, tie_word_embeddings=True))
    rng = torch.get_rng_state()
    draft = DraftTraining(DraftConfig(lr=3e-3), model)
    assert torch.equal(rng, torch.get_rng_state())  # made under a forked RNG: the run's stream is untouched
    assert head_of(model) is draft.head and any(k.startswith("draft_head.") for k in model.state_dict())
    policy = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("draft_head.")}
    batch = _batch()
    first = draft.step(model, batch)
    for _ in range(60):
        last = draft.step(model, batch)
    assert last["draft_loss"] < 0.5 * first["draft_loss"]
    for n, p in model.named_parameters():
        if not n.startswith("draft_head."):
            assert p.grad is None and torch.equal(p, policy[n]), n


def test_frozen_heads_do_not_train_in_rl_but_do_in_supervised_phases():
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=16))
    assert DraftTraining(DraftConfig(train=False), model).step(model, _batch(4)) == {}
    assert "draft_loss" in DraftTraining(DraftConfig(train=False), model, supervised=True).step(model, _batch(4))


def _model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
                                        max_position_embeddings=32, tie_word_embeddings=True))


def test_rl_takes_over_the_warm_starts_optimizer_state():
    """An RL phase's head that starts from the warm start's weights (a new trainer, handed the
    weights) continues the warm start's AdamW state: its first update is a small step on from
    where the warm start ended instead of a fresh AdamW's ``lr``-sized one on every weight, so its
    loss does not jump; a head with other weights keeps a fresh state."""
    batch, cfg = _batch(), DraftConfig(lr=1e-2)
    warm_model = _model()
    warm = DraftTraining(cfg, warm_model, supervised=True)
    for _ in range(40):
        warm.step(warm_model, batch)
    weights = dict(warm_model.state_dict())
    after = {}
    for name in ("fresh", "carried"):
        model = _model()
        rl = DraftTraining(cfg, model)
        if name == "fresh":
            rl._warm = None  # as a run whose RL phase has no warm start in its process
        model.load_state_dict(weights)
        before = rl.step(model, batch)["draft_loss"]
        after[name] = rl.step(model, batch)["draft_loss"]
        steps = {int(s["step"]) for s in rl.optim.state_dict()["state"].values()}
        assert steps == ({42} if name == "carried" else {2}), (name, steps)
    assert after["carried"] <= before * 1.05 < after["fresh"], (before, after)
    other = _model(1)
    rl = DraftTraining(cfg, other)  # not the warm start's head: fresh state
    rl.step(other, batch)
    assert {int(s["step"]) for s in rl.optim.state_dict()["state"].values()} == {1}


def _trained(updates: int) -> tuple[float, float]:
    """The draft_loss a step with ``updates`` passes reports, and the next step's (the head's loss
    on the same batch after that step)."""
    model, batch = _model(), _batch(8)
    draft = DraftTraining(DraftConfig(lr=3e-3, updates_per_step=updates), model)
    return draft.step(model, batch)["draft_loss"], draft.step(model, batch)["draft_loss"]


def test_more_updates_per_step_move_the_head_further_on_the_same_batch():
    before1, after1 = _trained(1)
    before2, after2 = _trained(2)
    assert before1 == pytest.approx(before2, rel=1e-6)  # the same head: the report is the first pass's
    assert after2 < after1 < before1


def test_updates_per_step_is_validated_and_warm_starts_take_one():
    with pytest.raises(ValidationError):
        DraftConfig(updates_per_step=0)
    cfg = DraftConfig(updates_per_step=3)
    assert DraftTraining(cfg, _model()).passes == 3
    assert DraftTraining(cfg, _model(), supervised=True).passes == 1
