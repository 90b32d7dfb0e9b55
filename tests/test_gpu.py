"""GPU paths (run on a CUDA machine: ``python -m pytest -m gpu tests/test_gpu.py``; CI has no GPU)."""
import json

import pytest

TINY = "tests/tiny.yaml"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tiny_run_on_cuda_trainer_and_engine(cli, tmp_path, mode):
    import torch

    assert torch.cuda.is_available()
    out = tmp_path / "run"
    r = cli("train", TINY, f"run.out_dir={out}", "trainer.device=cuda", "engine.device=cuda",
            "algorithm.filter_zero_variance=false", f"run.mode={mode}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [g["step"] for g in rows] == list(range(7))
    if mode == "async":  # samples a version old were trained with importance weights (on the GPU)
        assert any(g["staleness_mean"] > 0 and "importance_weight_mean" in g for g in rows[1:])
    # the engine and the trainer score the same tokens alike on the GPU too (fp32; async: on the
    # step's fresh samples only, so sync alone)
    assert mode == "async" or all(g["train_rollout_logprob_abs_diff"] < 1e-4 for g in rows[1:])
