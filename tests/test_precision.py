"""Low precision end to end: the supported training/rollout pairs run, the engine serves the
weights the trainer computed with (synced packed, through the tensor and disk transports), an
unsupported pair exits 2 at config time naming both keys, and the IcePop metrics reach the log."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from miles.cli import main
from miles.testing import assert_usage_error, run_module

ROOT = Path(__file__).resolve().parents[1]


def tiny_run(tmp_path, *overrides):
    out = tmp_path / "run"
    rc = main(["train", str(ROOT / "tests/tiny.yaml"), f"run.out_dir={out}", "run.steps=2", "run.eval_every=2",
               "run.checkpoint_every=2", "loggers=[]", "run.warm_start=null", "algorithm.filter_zero_variance=false",
               "rollout.batch_size=4", *overrides])
    assert rc == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("pair", [
    ["trainer.qat=int4", "engine.weights_dtype=int4", "transport.name=tensor"],
    ["trainer.qat=int4", "engine.weights_dtype=int4", "transport.name=disk"],
    ["trainer.precision=fp8", "engine.weights_dtype=fp8"],
    ["trainer.precision=mxfp8", "engine.weights_dtype=mxfp8"],
])
def test_matching_formats_keep_rollout_and_training_aligned(tmp_path, pair):
    rows = tiny_run(tmp_path, *pair)
    steps = [r for r in rows if r["step"] > 0 and "train_rollout_logprob_abs_diff" in r]
    assert len(steps) == 2
    # the engine computes with the trainer's rounded weights: only the forwards' float32 sums differ
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in steps), steps


def test_export_writes_the_weights_rollout_served(tmp_path, capsys):
    tiny_run(tmp_path, "trainer.qat=int4", "engine.weights_dtype=int4")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "export")]) == 0
    # rows 32 long are no multiple of compressed-tensors' 128-weight groups: the default stays dense, and says so
    assert "INT4 weights written dense" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "ct"), "--format", "compressed-tensors"]) == 2
    assert "multiple of 128" in capsys.readouterr().err and not (tmp_path / "ct").exists()
    from miles_lowp.int4 import qdq_int4
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    q = model.model.layers[0].self_attn.q_proj.weight.detach().float()
    # plain floats transformers loads, each row one scale times 16 integer levels (INT4 again)
    assert torch.allclose(qdq_int4(q), q, atol=1e-6)
    levels = torch.unique(q[0] / q[0].abs().max() * 7).round()
    assert len(levels) <= 16 and torch.allclose(torch.unique(q[0] / q[0].abs().max() * 7), levels, atol=1e-4)


def test_bf16_training_with_fp8_rollout_and_icepop(tmp_path):
    rows = tiny_run(tmp_path, "engine.weights_dtype=fp8", "algorithm.icepop=[0.5,2.0]")
    steps = [r for r in rows if r["step"] > 0 and "icepop_masked_frac" in r]
    assert len(steps) == 2
    # the engine rounds the bf16 trainer's weights: a real mismatch, which IcePop measures
    assert all(r["train_rollout_logprob_abs_diff"] > 1e-4 for r in steps), steps
    assert all(0 <= r["icepop_masked_frac"] < 0.5 and r["mismatch_ratio_max"] >= 1 for r in steps)


def test_an_unsupported_pair_exits_2_at_config_time():
    p = run_module("miles.cli", "train", str(ROOT / "tests/tiny.yaml"), "engine.weights_dtype=int4", timeout=120)
    assert_usage_error(p, "miles", "engine.weights_dtype: int4", "trainer.precision: bf16", "trainer.qat: int4")


@pytest.mark.parametrize("settings, words", [
    ({"trainer": {"precision": "fp8"}}, ["engine.weights_dtype: model", "trainer.precision: fp8"]),
    ({"trainer": {"precision": "mxfp8"}, "engine": {"weights_dtype": "fp8"}},
     ["engine.weights_dtype: fp8", "trainer.precision: mxfp8"]),
    ({"trainer": {"qat": "int4", "qat_scope": "experts"}, "engine": {"weights_dtype": "int4"}},
     ["engine.quant_scope: all", "trainer.qat_scope: experts"]),
])
def test_unsupported_pairs_are_config_problems(settings, words):
    from miles import ConfigError, make_plugin_manager
    from miles.config import resolve

    data = yaml.safe_load((ROOT / "tests/tiny.yaml").read_text())
    data["engine"] = {"name": "torch", **settings.get("engine", {})}
    data["trainer"].update(settings["trainer"])
    with pytest.raises(ConfigError) as e:
        resolve(make_plugin_manager(), data)
    assert all(w in str(e.value) for w in words), str(e.value)
