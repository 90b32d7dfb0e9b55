"""The draft head on multi-turn samples (a model turn, a tool's output, a model turn): it learns
the model's turns, and the tool's output (loss-masked: the engine never drafts it) is no target."""
import torch
from miles import Batch, Sample, Task
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles_draft.config import DraftConfig
from miles_draft.train import DraftTraining

TOOL = [13, 14, 15]  # the tool turn's tokens, fed to the model but not written by it


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
                                        max_position_embeddings=32, tie_word_embeddings=True))


def _samples(rows: int, tool_output) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):  # prompts of 2-4 tokens; each model turn counts up, predictable two ahead
        start = int(torch.randint(1, 6, (1,), generator=g))
        turn = [start + j for j in range(4)]
        tool = TOOL + tool_output(i)
        response = turn + tool + [t + 1 for t in turn]
        out.append(Sample(task=Task(prompt=""), prompt_ids=[1] * (2 + i % 3), response_ids=response,
                          loss_mask=[1] * 4 + [0] * len(tool) + [1] * 4))
    return out


def test_the_head_learns_the_model_turns_of_multi_turn_samples():
    model = _model()
    draft = DraftTraining(DraftConfig(lr=3e-3), model)
    batch = Batch.from_samples(_samples(12, lambda i: [i % 5 + 2]), 0)
    first = draft.step(model, batch)
    for _ in range(60):
        last = draft.step(model, batch)
    assert last["draft_loss"] < 0.5 * first["draft_loss"]


def test_the_tool_output_is_no_target():
    """Two batches that differ only in the tool's (masked) output and what follows it, with the
    turn after the tool masked too: the head's loss reads the first model turn alone, so a fresh
    head scores both the same; unmasking the second turn makes them differ."""
    losses = {}
    for name, tool_output, second in (("a", lambda i: [2, 3], 0), ("b", lambda i: [9, 11, 12], 0),
                                      ("a_unmasked", lambda i: [2, 3], 1), ("b_unmasked", lambda i: [9, 11, 12], 1)):
        samples = _samples(6, tool_output)
        for s in samples:
            s.loss_mask = s.loss_mask[:-4] + [second] * 4
        model = _model()
        losses[name] = DraftTraining(DraftConfig(), model).step(model, Batch.from_samples(samples, 0))["draft_loss"]
    assert abs(losses["a"] - losses["b"]) < 1e-6
    assert abs(losses["a_unmasked"] - losses["b_unmasked"]) > 1e-4
