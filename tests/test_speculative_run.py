"""Speculative decoding in a run: a draft head trained online (draft.train) reaches the engine
through the weight transport, its acceptance and loss are logged, true on-policy stays exactly
0.0 with speculation on, the checkpoint holds the head (a rerun resumes it) and miles export
writes it beside the model, where the engine (and miles serve) reads it."""
import json
from pathlib import Path

import pytest
import torch
from miles.cli import main
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SPEC = ["engine.speculative={draft: head, tokens: 2, max_batch: 4096}", "draft.lr=3.0e-3"]


def _run(out, *overrides, steps=3):
    rc = main(["train", str(ROOT / "tests/tiny.yaml"), f"run.out_dir={out}", f"run.steps={steps}",
               "run.eval_every=3", "run.checkpoint_every=3", "loggers=[]", "algorithm.filter_zero_variance=false",
               *SPEC, *overrides])
    assert rc == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("spec") / "run"
    return out, _run(out, "draft.train=true", "transport.name=disk", "rollout.true_on_policy=true")


def test_online_head_metrics_and_exact_on_policy(run):
    _, metrics = run
    steps = [m for m in metrics if m["step"] > 0]
    assert len(steps) == 3
    for m in steps:
        assert 1.0 <= m["spec_accept_len"] <= 3.0 and 0.0 <= m["spec_accept_rate"] <= 1.0
        assert m["draft_loss"] > 0 and "tokens_per_second" in m
        assert m["train_rollout_logprob_abs_diff"] == 0.0  # the engine's log-probs are the target's
    assert "eval_spec_accept_len" in steps[-1]


def test_checkpoint_resumes_the_head_and_export_writes_it(run, tmp_path):
    out, _ = run
    ckpt = sorted((out / "checkpoints").iterdir())[-1] / "trainer"
    assert (ckpt / "draft_optim.pt").is_file()
    folder = tmp_path / "export"
    assert main(["export", str(out), "--to", str(folder)]) == 0
    head = load_file(folder / "draft_head.safetensors")
    assert set(head) >= {"fc.weight", "gate_up.weight", "down.weight"}
    model = load_file(folder / "model.safetensors")
    assert not any(k.startswith("draft_head.") for k in model)
    eye = torch.zeros_like(head["fc.weight"])
    eye[:, :eye.shape[0]] = torch.eye(eye.shape[0])
    assert not torch.equal(head["fc.weight"], eye)  # trained away from its initial weights
    # a rerun with more steps resumes from the checkpoint, head included
    metrics = _run(out, "draft.train=true", "transport.name=disk", "rollout.true_on_policy=true", steps=4)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert "draft_loss" in metrics[-1]

    # the exported head drafts in an engine built from the exported folder
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine
    from miles_plugin_torch_engine.server import FolderSpec

    spec = FolderSpec(str(folder))
    cfg = TorchEngineConfig.model_validate({"speculative": {"draft": "head", "path": str(folder)}})
    engine = TorchEngine(cfg, spec=spec, tokenizer=spec.build_tokenizer())
    assert torch.equal(engine._spec.drafter.head.fc.weight, head["fc.weight"])


def test_draft_section_needs_a_head_in_the_engine(tmp_path, capsys):
    rc = main(["train", str(ROOT / "tests/tiny.yaml"), f"run.out_dir={tmp_path / 'r'}", "draft.train=true",
               "draft.unknown=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "engine.speculative: {draft: head}" in err and "draft.unknown" in err


def test_a_model_declaring_mtp_layers_trains_them_without_the_engine_drafting():
    """Qwen3-Next's MTP layers train online with no engine.speculative set (the engine does not
    draft), with either trainer; megatron refuses pipeline stages for them and says so."""
    from miles import MilesError
    from miles.cli import load

    mtp = ["draft.train=true", "model.config.mtp_num_hidden_layers=1"]
    load(str(ROOT / "tests/tiny.yaml"), mtp, [])
    with pytest.raises(MilesError, match="engine.speculative: {draft: head}"):
        load(str(ROOT / "tests/tiny.yaml"), ["draft.train=true"], [])
    with pytest.raises(MilesError, match="pipeline"):
        load(str(ROOT / "tests/tiny.yaml"), [*mtp, "trainer.name=megatron", "trainer.pipeline_parallel=2"], [])


def test_launched_trainer_ranks_train_the_draft_for_the_launchers_engines(monkeypatch):
    """A launcher gives its trainer ranks ``engine: {name: sglang, urls: [...]}`` (its ``miles
    serve`` workers, which draft) and keeps the draft: section: those ranks accept it; a run
    configured by hand with a non-drafting engine does not."""
    from miles import MilesError
    from miles.cli import load

    ranks = ["draft.train=true", "engine={name: sglang, urls: ['http://127.0.0.1:1']}"]
    with pytest.raises(MilesError, match="engine.speculative: {draft: head}"):
        load(str(ROOT / "tests/tiny.yaml"), ranks, [])
    monkeypatch.setenv("MILES_LAUNCHED", "1")
    load(str(ROOT / "tests/tiny.yaml"), ranks, [])
