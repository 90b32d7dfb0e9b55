"""The draft head's online training: it learns the policy's next-next-token distribution and
leaves no gradient on the policy."""
import torch
from miles import Batch, Sample, Task
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
