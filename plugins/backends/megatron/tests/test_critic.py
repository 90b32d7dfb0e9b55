"""The megatron trainer's critic (PPO) on CPU through tests/cpu_shim.py: its values are the HF
backbone's hidden states through the value head, it learns returns, and a PPO run uses it."""
import pytest
import torch
from helpers import Spec, batch
from miles_plugin_megatron.config import MegatronConfig


def make_critic(family: str, **cfg):
    from types import SimpleNamespace

    from miles_plugin_megatron import _make

    cfg = MegatronConfig(device="cpu", precision="fp32", **{"lr": 1e-3, **cfg})
    algo = SimpleNamespace(needs_critic=True, critic_lr=1e-2, value_loss=mse)  # a CriticAlgorithm
    return _make(cfg, spec=Spec(family), tokenizer=None, seed=0, total_steps=10, algorithm=algo)


def hf_values(hf: torch.nn.Module, head: torch.nn.Linear, b) -> torch.Tensor:
    """V_t from the HF backbone (final norm included) at the position that predicts token t."""
    with torch.no_grad():
        h = hf.base_model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                          position_ids=b.position_ids).last_hidden_state[:, b.prompt_len - 1:-1]
        return head(h.float()).squeeze(-1)


def mse(mb, values):
    target = mb.extras["returns"]
    return ((values - target) ** 2 * mb.loss_mask).sum() / mb.global_tokens, {}


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_values_are_the_hf_backbone_through_the_head(megatron_cpu, family):
    from miles.protocols import SupportsCritic

    tr = make_critic(family)
    assert isinstance(tr, SupportsCritic)
    b = batch(rows=5)
    assert torch.equal(tr.values(b), torch.zeros(5, b.loss_mask.shape[1]))  # zero head
    torch.manual_seed(5)
    with torch.no_grad():
        tr.critic.head.weight.normal_()
        tr.critic.head.bias.fill_(0.3)
    hf = Spec(family).build_model(None).eval()
    hf.load_state_dict(dict(tr.named_weights()))
    got, want = tr.values(b), hf_values(hf, tr.critic.head, b)
    assert got.shape == want.shape == b.loss_mask.shape
    assert got.abs().max() > 0.1
    assert ((got - want) * b.loss_mask).abs().max() < 1e-4


def test_train_critic_learns_returns_and_leaves_the_policy(megatron_cpu):
    tr = make_critic("llama", micro_batch_size=2)
    b = batch(rows=5)
    b.extras["returns"] = torch.where(b.advantages > 0, 1.0, -1.0)
    policy_before = tr.logprobs(b)
    errors = []
    for _ in range(8):
        v = tr.values(b)
        errors.append(float(((v - b.extras["returns"]) ** 2 * b.loss_mask).sum() / b.loss_mask.sum()))
        m = tr.train_critic(b, mse)
        assert m["critic_grad_norm"] > 0
    assert errors[-1] < 0.5 * errors[0], errors
    assert torch.equal(tr.logprobs(b), policy_before)  # the critic has its own weights
    assert all(p.grad is None for p in tr.model.parameters())


@pytest.mark.slow
def test_ppo_loop_with_megatron_critic(megatron_cpu, tmp_path):
    """``miles train`` with ``algorithm.name: ppo`` and ``trainer.name: megatron``: the loop asks the
    trainer for values and critic steps, and the run resumes from its checkpoint with the critic."""
    import json
    from pathlib import Path

    from miles.cli import main

    here = Path(__file__).parent
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model: {name: hf, config: {model_type: qwen2, hidden_size: 64, intermediate_size: 128, "
        "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
        "max_position_embeddings: 32, tie_word_embeddings: true}}\n"
        "env: {name: arith, digits: 2, eval_size: 8}\n"
        "rollout: {batch_size: 4, n: 2, temperature: 1.0, max_new_tokens: 4}\n"
        "engine: {name: torch}\nalgorithm: {name: ppo, critic_lr: 1.0e-3}\n"
        "trainer: {name: megatron, device: cpu, precision: fp32, lr: 1.0e-3}\nsync: {name: tensor}\n"
        f"run: {{steps: 2, out_dir: {tmp_path / 'out'}, eval_every: 100, checkpoint_every: 2, threads: 2}}\n")
    plugin = ["--plugin", str(here / "even_token_reward.py")]
    assert main(["train", str(cfg), *plugin]) == 0
    assert main(["train", str(cfg), *plugin, "run.steps=3"]) == 0  # resumes at step 2
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["critic_grad_norm"] > 0 and "value_loss" in r for r in steps)
    assert steps[0]["value_mean"] == 0  # zero head: the first values are 0
    assert steps[2]["value_mean"] != 0  # the resumed critic is the trained one
