"""The megatron trainer on CPU through tests/cpu_shim.py (megatron-core's forward asserts CUDA):
GPTModels built from HF configs compute the HF model's log-probs, train, export and resume."""
import pytest
import torch
from helpers import Spec, batch, hf_logprobs
from miles_plugin_megatron.config import MegatronConfig
from miles_telemetry import untimed


def make(family: str, seed: int = 0, **cfg):
    from miles_plugin_megatron.trainer import MegatronTrainer

    cfg = MegatronConfig(device="cpu", precision="fp32", **{"lr": 1e-3, **cfg})
    return MegatronTrainer(cfg, spec=Spec(family), tokenizer=None, seed=seed, total_steps=10)


def loss_fn(mb, lp):
    return -mb.token_mean(lp * mb.advantages), {"lp_mean": float(lp.detach().mean())}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_logprobs_equal_hf_on_left_padded_batch(megatron_cpu, family):
    tr = make(family)
    b = batch()
    hf = Spec(family).build_model(None).eval()
    hf.load_state_dict(dict(tr.named_weights()))  # the export loads strictly into the HF model
    got, want = tr.logprobs(b), hf_logprobs(hf, b)
    assert got.shape == want.shape
    assert ((got - want) * b.loss_mask).abs().max() < 1e-5
    b.temperature = 0.7
    assert ((tr.logprobs(b) - hf_logprobs(hf, b)) * b.loss_mask).abs().max() < 1e-5


def test_train_step_matches_hf_gradient_step(megatron_cpu):
    """One SGD-like AdamW step on both models gives the same weights (AdamW's first step moves
    each weight by ~lr * sign(grad): equal updates mean equal gradient signs everywhere)."""
    tr = make("qwen2", grad_clip=None)
    b = batch()
    hf = Spec("qwen2").build_model(None)
    hf.load_state_dict(dict(tr.named_weights()))
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.0)
    logits = hf(input_ids=b.input_ids, attention_mask=b.attention_mask,
                position_ids=b.position_ids).logits[:, b.prompt_len - 1:-1].float()
    lp = logits.log_softmax(-1).gather(-1, b.input_ids[:, b.prompt_len:, None])[..., 0]
    loss, _ = loss_fn(b, lp)
    loss.backward()
    opt.step()
    metrics = tr.train_step(b, loss_fn)
    assert abs(metrics["loss"] - float(loss.detach())) < 1e-5
    assert metrics["grad_norm"] > 0 and metrics["lr"] == 1e-3
    mine = dict(tr.named_weights())
    for k, v in hf.state_dict().items():
        assert (mine[k] - v).abs().max() < 1e-4, k


def test_micro_batches_reference_and_weight_round_trip(megatron_cpu):
    tr = make("qwen3_moe", micro_batch_size=3)
    b = batch(rows=5)
    before = tr.logprobs(b)
    tr.snapshot_reference()
    for _ in range(2):
        m = tr.train_step(b, loss_fn)
    assert m["loss"] != 0 and "lp_mean" in m
    after = tr.logprobs(b)
    assert (after - before).abs().max() > 1e-4  # the policy moved
    assert torch.equal(tr.logprobs(b, "ref"), before)  # the reference did not
    named = {k: v.clone() for k, v in tr.named_weights()}
    other = make("qwen3_moe", seed=7, micro_batch_size=3)
    assert not torch.equal(other.logprobs(b), after)
    other.load_weights(named.items())
    assert torch.equal(other.logprobs(b), after)


def test_save_load_resumes_exactly(megatron_cpu, tmp_path):
    tr = make("llama")
    b = batch()
    tr.train_step(b, loss_fn)
    tr.snapshot_reference()
    tr.save(str(tmp_path / "ck"))
    from helpers import read_tensors

    stored = read_tensors(str(tmp_path / "ck"))  # megatron-core's global tensors, read in one process
    embed = dict(tr.named_weights())["model.embed_tokens.weight"]
    assert torch.equal(stored["embedding.word_embeddings.weight"], embed)
    again = make("llama", seed=3)
    again.load(str(tmp_path / "ck"))
    assert torch.equal(again.logprobs(b, "ref"), tr.logprobs(b, "ref"))
    m1, m2 = tr.train_step(b, loss_fn), again.train_step(b, loss_fn)
    assert untimed(m1) == untimed(m2)  # same weights, AdamW moments, step count and LR schedule
    for (k, v), (k2, v2) in zip(tr.named_weights(), again.named_weights()):
        assert k == k2 and torch.equal(v, v2), k


class _Plant:
    """A pickle that writes a file when loaded, as a planted checkpoint file would run code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_planted_metadata_pickle_is_refused_before_it_runs(megatron_cpu, tmp_path):
    import pickle

    from miles import MilesError

    tr = make("qwen2")
    tr.save(str(tmp_path / "ck"))
    marker = tmp_path / "ran"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    with pytest.raises(MilesError, match="unsafe .metadata"):
        make("qwen2", seed=3).load(str(tmp_path / "ck"))
    assert not marker.exists()


def test_load_weights_rejects_foreign_names(megatron_cpu):
    from miles import MilesError

    tr = make("qwen2")
    with pytest.raises(MilesError, match="not a weight of this model"):
        tr.load_weights([("transformer.h.0.attn.weight", torch.zeros(1))])


@pytest.mark.slow
def test_grpo_loop_with_megatron_trainer(megatron_cpu, tmp_path):
    """``miles train`` with ``trainer.name: megatron``: engine and trainer log-probs agree, and
    GRPO raises a reward the random model can earn (first response token even)."""
    import json
    from pathlib import Path

    from miles.cli import main

    here = Path(__file__).parent
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model: {name: hf, config: {model_type: qwen2, hidden_size: 64, intermediate_size: 128, "
        "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
        "max_position_embeddings: 32, tie_word_embeddings: true}}\n"
        "env: {name: arith, digits: 2, eval_size: 16}\n"
        "rollout: {batch_size: 8, n: 4, temperature: 1.0, max_new_tokens: 4}\n"
        "engine: {name: torch}\nalgorithm: {name: grpo, filter_zero_variance: false}\n"
        "trainer: {name: megatron, device: cpu, precision: fp32, lr: 1.0e-3}\nsync: {name: tensor}\n"
        f"run: {{steps: 8, out_dir: {tmp_path / 'out'}, eval_every: 8, checkpoint_every: 8, threads: 2}}\n")
    assert main(["train", str(cfg), "--plugin", str(here / "even_token_reward.py")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 8
    assert max(r["train_rollout_logprob_abs_diff"] for r in steps) < 1e-5
    rewards = [r["reward_mean"] for r in steps]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3



def test_model_spec_swaps_a_layer_module(megatron_cpu):
    """A model spec's ``megatron_layer_spec`` replaces a module of the Megatron layer spec (here
    the core attention, by a subclass that counts its calls) without patching megatron-core."""
    from miles_plugin_megatron.arch import SDPAttention
    from miles_plugin_megatron.trainer import MegatronTrainer

    calls = []

    class CountingAttention(SDPAttention):
        def forward(self, *args, **kwargs):
            calls.append(1)
            return super().forward(*args, **kwargs)

    class CustomSpec(Spec):
        def megatron_layer_spec(self, layer_spec):
            layer_spec.submodules.self_attention.submodules.core_attention = CountingAttention
            return layer_spec

    tr = MegatronTrainer(MegatronConfig(device="cpu", precision="fp32"), spec=CustomSpec("llama"), tokenizer=None)
    kinds = {type(m).__name__ for m in tr.model.modules()}
    assert "CountingAttention" in kinds and "SDPAttention" not in kinds
    tr.logprobs(batch())
    assert len(calls) == 2  # one forward, two decoder layers
