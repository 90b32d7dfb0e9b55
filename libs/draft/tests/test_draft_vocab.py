"""A reduced draft vocabulary (``draft.vocab``): the subset follows the running counts of the
training targets, targets outside it leave the loss, the subset and counts travel with the head's
weights (checkpoints, its file), and bad sizes are refused with the key named."""
from pathlib import Path

import pytest
import torch
from miles import Batch, ConfigError, Sample, Task
from pydantic import ValidationError
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles_draft.config import DraftConfig
from miles_draft.files import load_head, save_head, split
from miles_draft.head import make_head
from miles_draft.train import DraftTraining

V, N = 32, 16
ROOT = Path(__file__).resolve().parents[3]


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                        max_position_embeddings=32, tie_word_embeddings=True))


def _batch(responses: list[list[int]], masks: list[list[int]] | None = None) -> Batch:
    samples = [Sample(task=Task(prompt=""), prompt_ids=[1, 2], response_ids=r,
                      loss_mask=m if masks else [1] * len(r)) for r, m in zip(responses, masks or responses)]
    return Batch.from_samples(samples, 0)


def _top(counts: torch.Tensor) -> list[int]:
    """The N most counted ids (ties: the lower id), in increasing order."""
    return sorted(sorted(range(V), key=lambda i: (-int(counts[i]), i))[:N])


def test_the_subset_follows_the_counts():
    model = _model()
    draft = DraftTraining(DraftConfig(vocab=N), model)
    head = draft.head
    assert head.subset().tolist() == list(range(N))  # nothing counted yet: the first N ids
    # the targets are the response tokens after the first, where the loss mask is set
    responses = [[5, 20, 21, 21, 30], [6, 22, 22, 31, 9]]
    masks = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 1]]  # 31 is a tool's token: no target
    draft.step(model, _batch(responses, masks))
    want = torch.zeros(V, dtype=torch.long)
    for t in [20, 21, 21, 30, 22, 22, 9]:
        want[t] += 1
    assert torch.equal(head.vocab_counts, want)
    got = head.subset().tolist()
    assert got == _top(want) and {20, 21, 22, 30, 9} <= set(got) and 31 not in got
    # a further step adds to the counts, and the subset follows them
    draft.step(model, _batch([[1] + list(range(16, 32)) * 2]))
    want[16:32] += 2
    assert torch.equal(head.vocab_counts, want) and head.subset().tolist() == _top(want)
    assert head.subset().tolist() == list(range(16, 32))  # each counted at least twice; 9 once: out


def test_targets_outside_the_subset_leave_the_loss():
    model = _model()
    draft = DraftTraining(DraftConfig(vocab=N), model)
    draft.head.vocab_counts[:N] = 1000  # the subset stays 0 .. 15 whatever these batches add
    outside = draft.step(model, _batch([[3, 17, 18, 19, 20, 21]] * 4))
    assert outside["draft_vocab_cover"] == 0.0 and outside["draft_loss"] == 0.0
    assert draft.head.subset().tolist() == list(range(N))
    half = draft.step(model, _batch([[3, 4, 5, 20, 21]] * 4))
    assert half["draft_vocab_cover"] == pytest.approx(0.5) and half["draft_loss"] > 0
    assert "draft_vocab_cover" not in DraftTraining(DraftConfig(), _model()).step(model, _batch([[3, 4, 5]]))


def test_the_head_learns_over_its_subset():
    model = _model()
    draft = DraftTraining(DraftConfig(vocab=N, lr=3e-3), model)
    g = torch.Generator().manual_seed(0)
    rows = [[(s + i) % 8 + 20 for i in range(8)] for s in torch.randint(0, 8, (16,), generator=g).tolist()]
    first = draft.step(model, _batch(rows))
    for _ in range(40):
        last = draft.step(model, _batch(rows))
    assert set(range(20, 28)) <= set(draft.head.subset().tolist())
    assert last["draft_vocab_cover"] == 1.0 and last["draft_loss"] < 0.5 * first["draft_loss"]
    assert last["draft_top1"] > first["draft_top1"]


def test_checkpoints_and_the_head_file_keep_the_subset_and_counts(tmp_path):
    model = _model()
    draft = DraftTraining(DraftConfig(vocab=N), model)
    draft.step(model, _batch([[1, 20, 21, 22, 23, 24]]))
    state = {k: v.clone() for k, v in model.state_dict().items()}  # what a checkpoint and a weight sync carry
    assert state["draft_head.draft_vocab"].shape == (V,) and state["draft_head.vocab_counts"].sum() == 5
    # a resumed run: a fresh model and head, the checkpoint loaded, counting on from it
    resumed = _model()
    again = DraftTraining(DraftConfig(vocab=N), resumed)
    resumed.load_state_dict(state)
    assert torch.equal(again.head.draft_vocab, state["draft_head.draft_vocab"])
    again.step(resumed, _batch([[1, 25, 25]]))
    assert int(again.head.vocab_counts.sum()) == 7 and int(again.head.vocab_counts[25]) == 2
    # the exported file loads into a head made without draft.vocab (the engine's)
    save_head(split(resumed.state_dict().items())[1], str(tmp_path))
    engine_head = make_head(resumed.config, torch.device("cpu"), torch.float32)
    assert engine_head.subset() is None
    load_head(engine_head, str(tmp_path))
    assert torch.equal(engine_head.subset(), again.head.subset())
    assert torch.equal(engine_head.vocab_counts, again.head.vocab_counts)


def test_bad_sizes_are_refused_naming_the_key(tmp_path, capsys):
    with pytest.raises(ValidationError, match="greater than or equal to 16"):
        DraftConfig(vocab=8)
    with pytest.raises(ConfigError, match="draft.vocab: 40 is more than the model's vocabulary of 32"):
        make_head(_model().config, torch.device("cpu"), torch.float32, draft_vocab=40)
    from miles.cli import main

    args = ["train", str(ROOT / "tests/tiny.yaml"), f"run.out_dir={tmp_path / 'r'}",
            "engine.speculative={draft: head}", "model.config.vocab_size=64"]
    assert main([*args, "draft.vocab=8"]) == 2
    err = capsys.readouterr().err
    assert "draft.vocab" in err and "16" in err
    assert main([*args, "draft.vocab=100"]) == 2
    assert "draft.vocab: 100 is more than the model's vocabulary of 64 tokens" in capsys.readouterr().err
