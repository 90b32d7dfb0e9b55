"""Forward-process scoring (``extras["x_t"]``) and ODE training rollouts (``rollout.sampler: ode``)."""
import dataclasses

import pytest
import torch
from miles import Batch, SamplingParams
from miles_plugin_diffusers import sde
from miles_plugin_diffusers.config import DiffusersEngineConfig, DiffusersModelConfig, DiffusionRolloutConfig, \
    ShapesEnvConfig
from miles_plugin_diffusers.engine import DiffusersEngine
from miles_plugin_diffusers.env import ShapesEnv
from miles_plugin_diffusers.rollout import DiffusionRollout
from miles_plugin_diffusers.spec import DiffusersSpec

K = 2


@pytest.fixture(scope="module")
def parts():
    env = ShapesEnv(ShapesEnvConfig(colours=["red", "blue"], shapes=["square"], eval_images=2))
    spec = DiffusersSpec(DiffusersModelConfig(transformer={"num_layers": 1}))
    tok = spec.build_tokenizer(env.tokenizer())
    return env, spec, tok, DiffusersEngine(DiffusersEngineConfig(num_steps=3), spec=spec, tokenizer=tok)


def _ode_samples(parts, seed, tmp_path=None):
    env, _, tok, engine = parts
    rollout = DiffusionRollout(DiffusionRolloutConfig(sampler="ode", samples_dir=str(tmp_path) if tmp_path else None))
    groups = rollout.generate(env.tasks("train"), 2, engine=engine, env=env, tokenizer=tok,
                              params=SamplingParams(temperature=1.0, seed=seed))
    return [s for g in groups for s in g]


def test_ode_training_rollouts_start_from_random_noise(parts, tmp_path):
    a, b = _ode_samples(parts, 1, tmp_path), _ode_samples(parts, 2)
    assert all(s.logprobs == [0.0] * 3 and s.loss_mask == [0] * 3 for s in a)
    assert all(not s.extensions["diffusers"]["stochastic"] for s in a)
    assert not torch.equal(a[0].extensions["diffusers"]["image"], b[0].extensions["diffusers"]["image"])
    assert not list(tmp_path.iterdir())  # grids are written for evaluations only


def _batch(samples, decay):
    g = torch.Generator().manual_seed(0)
    x0 = torch.stack([s.extensions["diffusers"]["latents"][-1] for s in samples])
    B = len(samples)
    sigma = torch.rand(B, K, generator=g)
    x_t = (1 - sigma[..., None, None, None]) * x0[:, None] + sigma[..., None, None, None] * torch.randn(
        B, K, *x0.shape[1:], generator=g)
    extras = {"x_t": x_t, "sigma_t": sigma, "old_decay": decay,
              **{k: torch.stack([s.extensions["diffusers"][k] for s in samples]) for k in ("embeds", "pooled")}}
    ones = torch.ones(B, K)
    return Batch(None, None, None, 0, ones, ones, ones * 0, torch.zeros(B), list(samples), extras=extras)


def test_forward_scoring_returns_the_model_and_old_policy_velocities(parts):
    _, spec, tok, _ = parts
    samples = _ode_samples(parts, 3)
    model = spec.build_model(tok).train()
    batch = _batch(samples, 0.5)
    out = spec.action_logprobs(model, batch)
    B, D = len(samples), 3 * 8 * 8
    assert out.shape == (B, 2 * K * D)
    x, sig = batch.extras["x_t"].reshape(B * K, 3, 8, 8), batch.extras["sigma_t"].reshape(B * K)
    cond = {k: batch.extras[k].repeat_interleave(K, 0) for k in ("embeds", "pooled")}
    direct = sde.velocity(model, x, sig, cond, 1.0).reshape(B, -1)
    assert torch.allclose(out[:, :K * D], direct, atol=1e-6)
    assert torch.equal(out[:, K * D:], out[:, :K * D].detach())  # the old policy starts as the model
    out[:, :K * D].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())

    # a new weight version folds the model into the old policy: old <- 0.5 old + 0.5 new
    name, before = next((n, p.detach().clone()) for n, p in model.named_parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    newer = [dataclasses.replace(s, weight_version=1) for s in samples]
    spec.action_logprobs(model, _batch(newer, 0.5))
    old = dict(spec._old.module.named_parameters())[name]
    assert torch.allclose(old, before + 0.5, atol=1e-6)
    spec.action_logprobs(model, _batch(newer, 0.5))  # the same version again (a micro-batch): unchanged
    assert torch.allclose(dict(spec._old.module.named_parameters())[name], before + 0.5, atol=1e-6)


def test_the_old_policy_is_training_state_a_fresh_spec_takes_back(parts):
    """``training_state``/``load_training_state`` (``KeepsTrainingState``): a new spec and model
    given the state go on folding the EMA as the original does; a state of another model is refused."""
    from miles import MilesError
    from miles.protocols import KeepsTrainingState

    _, spec, tok, _ = parts
    cfg = spec.cfg
    samples = _ode_samples(parts, 4)
    a_spec, b_spec = DiffusersSpec(cfg), DiffusersSpec(cfg)
    assert isinstance(a_spec, KeepsTrainingState)
    a, b = spec.build_model(tok), spec.build_model(tok)
    assert a_spec.training_state(a) == {}  # no forward-process batch scored yet: nothing to keep

    def step(s, model, version):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9).add_(0.01 * version)
        return s.action_logprobs(model, _batch([dataclasses.replace(x, weight_version=version) for x in samples], 0.5))

    step(a_spec, a, 0)
    step(a_spec, a, 1)
    saved = {k: v.clone() for k, v in a_spec.training_state(a).items()}  # as a checkpoint holds it
    assert int(saved["old_policy_version"]) == 1 and len(saved) == len(a.state_dict()) + 1
    b.load_state_dict(a.state_dict())
    b_spec.load_training_state(b, saved)
    assert b_spec._old.version == 1
    assert all(t.device == p.device for t, p in zip(b_spec._old.module.parameters(), b.parameters()))
    out_a, out_b = step(a_spec, a, 2), step(b_spec, b, 2)
    assert torch.equal(out_a, out_b)  # the old policy's velocities too: the same EMA, folded alike
    half = out_a.shape[1] // 2
    assert not torch.equal(out_a[:, half:], out_a[:, :half])  # the EMA lags: a restart from b would differ

    other = DiffusersSpec(cfg.model_copy(update={"transformer": {"num_layers": 2}}))
    with pytest.raises(MilesError, match="does not fit this model"):
        other.load_training_state(other.build_model(tok), saved)
