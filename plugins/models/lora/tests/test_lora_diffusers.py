"""LoRA over the diffusers model spec: Flow-GRPO steps through the kernel loop train only the
transformer's attention adapters, the engine receives the base once and then adapters only,
the run resumes, and the export is a diffusers folder with the adapters merged."""
import json
from pathlib import Path

import pytest
import torch
from miles.cli import main

ROOT = Path(__file__).resolve().parents[4]
RECIPE = ROOT / "recipes" / "diffusion_lora.yaml"
# a small shape; no warm start: a reward plugin scoring brightness gives every group a spread
TINY = ["model.base.warm_start=null", "model.target_modules=[to_q, to_k, to_v, to_out.0]", "model.r=8",
        "model.base.transformer={num_layers: 1, num_attention_heads: 2, attention_head_dim: 16, patch_size: 2}",
        "env.colours=[red, blue]", "env.shapes=[square]",
        "env.eval_images=2", "rollout.batch_size=2", "rollout.n=4", "engine.num_steps=3", "loggers=[]",
        "run.eval_every=100", "run.checkpoint_every=2", "run.threads=1"]
BRIGHTNESS = '''
from miles import hookimpl

@hookimpl
def miles_reward(sample):
    return float(sample.extensions["diffusers"]["image"].mean())
'''


@pytest.fixture
def recorded(monkeypatch):
    """Every ``load_weights`` call of the diffusers engine: (engine, {name: tensor copy})."""
    from miles_plugin_diffusers.engine import DiffusersEngine

    calls, real = [], DiffusersEngine.load_weights

    def load_weights(self, named_tensors, version):
        named = list(named_tensors)
        calls.append((self, {n: t.detach().clone() for n, t in named}))
        return real(self, named, version)

    monkeypatch.setattr(DiffusersEngine, "load_weights", load_weights)
    return calls


def test_flow_grpo_with_lora_trains_and_syncs_only_adapters(tmp_path, recorded):
    plugin = tmp_path / "brightness.py"
    plugin.write_text(BRIGHTNESS)
    out = tmp_path / "run"
    args = ["train", str(RECIPE), "--plugin", str(plugin), f"run.out_dir={out}", *TINY]
    assert main([*args, "run.steps=2"]) == 0
    engine, first = recorded[0]
    assert any("base_layer" in n for n in first) and any("lora_" in n for n in first)  # the base, once
    later = [list(named) for _, named in recorded[1:]]
    assert later and all(names and all(".lora_A." in n or ".lora_B." in n for n in names) for names in later)
    # only the attention projections carry adapters: to_q, to_k, to_v, to_out.0 (A and B each)
    assert {n.split(".attn.")[1].split(".lora_")[0] for n in later[0]} == {"to_q", "to_k", "to_v", "to_out.0"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["train_rollout_logprob_abs_diff"] == 0.0 for r in train)
    assert train[-1]["weight_sync_bytes"] == sum(4 * engine.model.get_parameter(n).numel() for n in later[-1])

    # what the engine holds now is the trainer's: adapters moved, every base weight as first synced
    changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p, first[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any(".lora_A." in n for n in changed) and any(".lora_B." in n for n in changed)

    # the same command with one step more resumes from the step-2 checkpoint
    assert main([*args, "run.steps=3"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3], steps

    # export: the adapters merged into a transformer diffusers loads, without adapter weights
    from diffusers import SD3Transformer2DModel

    assert main(["export", str(out), "--to", str(tmp_path / "export")]) == 0
    merged = SD3Transformer2DModel.from_pretrained(tmp_path / "export" / "transformer")
    names = {n for n, _ in merged.named_parameters()}
    assert not any("lora" in n or "base_layer" in n for n in names)
    q = "transformer_blocks.0.attn.to_q.weight"
    assert q in names and not torch.equal(merged.get_parameter(q), first[q.replace(
        "to_q.weight", "to_q.base_layer.weight")])  # B @ A folded in
    assert (tmp_path / "export" / "text_encoder").is_dir() and (tmp_path / "export" / "tokenizer").is_dir()


def test_lora_over_diffusers_is_a_valid_diffusion_model_spec(capsys):
    # the diffusers plugin's cross-section check sees the wrapped spec's name
    assert main(["train", str(RECIPE), "model.base.name=hf", "run.out_dir=/nonexistent/never"]) == 2
    assert "engine.name diffusers needs model.name diffusers (or lora with model.base.name diffusers)" in \
        capsys.readouterr().err


def test_the_base_specs_capabilities_show_through():
    from miles.protocols import ScoresActions
    from miles_plugin_lora.config import LoraSpecConfig
    from miles_plugin_lora.spec import LoraSpec

    diffusion = LoraSpec(LoraSpecConfig(base={"name": "diffusers", "image_size": 8}))
    assert isinstance(diffusion, ScoresActions) and not diffusion.causal_lm
    assert diffusion.action_logprobs.__self__ is diffusion.base and diffusion.peft_config().task_type is None
    lm = LoraSpec(LoraSpecConfig(base={"name": "hf", "config": {"model_type": "qwen2", "hidden_size": 32,
                                                                   "num_hidden_layers": 1}}))
    assert not isinstance(lm, ScoresActions) and lm.causal_lm and lm.peft_config().task_type == "CAUSAL_LM"
    with pytest.raises(AttributeError):
        lm.text_encoder  # noqa: B018 - an hf base has none, so neither has its lora spec
