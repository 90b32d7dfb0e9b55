"""The real-model path on a tiny random GGUF chat model (the pretrained one is measured by
benchmarks/real_model.py): recipes/real_model.yaml loads a GGUF file through the hf spec, trains
GRPO steps on chat prompts graded by the final number, evaluates held-out pass@1, and ``miles
export`` writes a safetensors folder that transformers and ``miles serve`` load."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``benchmarks/real_model.py --quick``: the recipe on a tiny random GGUF model, two steps."""
    tmp = tmp_path_factory.mktemp("real_model")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_model.py"), "--quick",
                          "--out", str(tmp / "run"), "--json", str(tmp / "f.json"), "--plot", str(tmp / "c.png")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return tmp, run


def test_quick_run_trains_and_evaluates_on_chat_prompts(quick):
    tmp, run = quick
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 1, 2]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2 and all("regex_no_match" in r for r in steps)  # the env's reward graded them
    f = json.loads((tmp / "f.json").read_text())
    assert f["steps"] == 2 and f["before"] == rows[0]["eval_accuracy"]
    assert "real_model pass@1 gain" in run.stdout.splitlines()[-1]
    assert (tmp / "c.png").read_bytes()[:4] == b"\x89PNG"
    cfg = (tmp / "run" / "config.yaml").read_text()
    assert "gguf_file: tiny.gguf" in cfg and "format: chat" in cfg


def test_export_of_a_gguf_run_loads_in_transformers_and_miles_serve(quick, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.testing import served
    from miles_plugin_hf.config import HFModelConfig
    from miles_plugin_hf.spec import HFModelSpec

    tmp, _ = quick
    out = tmp_path / "exported"
    r = subprocess.run([sys.executable, "-m", "miles.cli", "export", str(tmp / "run"), "--to", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    folder = json.loads((tmp / "f.json").read_text())["model"]
    spec = HFModelSpec(HFModelConfig(path=folder, gguf_file="tiny.gguf"))
    gguf_tok = spec.build_tokenizer()
    messages = [{"role": "user", "content": "What is 12 + 3?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == gguf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    # the checkpoint's weights, as the trainer holds them: same shapes and names as the GGUF model's
    assert model.state_dict().keys() == spec.build_model(gguf_tok).state_dict().keys()
    assert torch.isfinite(model(torch.tensor([ids])).logits).all()
    import httpx

    with served(out) as url:
        model_id = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": model_id, "messages": messages, "max_tokens": 3, "temperature": 0}).json()
    assert "choices" in reply, reply
    assert reply["choices"][0]["message"]["role"] == "assistant" and reply["usage"]["completion_tokens"] >= 1
