"""The speculative-decoding draft head trained online by the megatron trainer (a ``draft:``
section): it learns toward the policy, leaves the policy's update as without it, reaches the
engine's head under its names, computes the loss the fsdp2 path (the Hugging Face model's) does,
and comes back from a checkpoint with its optimizer."""
import pytest
import torch
from helpers import Spec, batch
from miles_plugin_megatron.config import MegatronConfig
from miles_telemetry import untimed

HEAD = {"lr": 3e-2}
SHARP = {"initializer_range": 0.2}  # a random policy with distributions far from uniform


def make(draft=None, seed: int = 0, **cfg):
    from miles_plugin_megatron.trainer import MegatronTrainer

    cfg = MegatronConfig(device="cpu", precision="fp32", **{"lr": 1e-3, **cfg})
    return MegatronTrainer(cfg, spec=Spec("qwen2", **SHARP), tokenizer=None, seed=seed, total_steps=10, draft=draft)


def loss_fn(mb, lp):
    return -mb.token_mean(lp * mb.advantages), {}


def policy_only(named):
    return {k: v for k, v in named if not k.startswith("draft_head.")}


def test_head_learns_and_the_policy_update_is_unchanged(megatron_cpu):
    """A head moved away from its start (which already guesses a random policy well) learns back
    toward the policy over a few steps; the policy's steps are those of a run without a draft."""
    tr, plain = make(HEAD, lr=1e-4), make(lr=1e-4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        tr.draft.head.fc.weight.add_(0.3 * torch.randn(tr.draft.head.fc.weight.shape, generator=g))
    b = batch(rows=6, response=8)
    drafts = []
    for _ in range(6):
        m, want = tr.train_step(b, loss_fn), plain.train_step(b, loss_fn)
        drafts.append(m.pop("draft_loss"))
        assert 0 <= m.pop("draft_top1") <= 1
        assert untimed(m) == untimed(want)  # the head's presence and step leave the policy's alone
    assert drafts[-1] < 0.5 * drafts[0] and drafts[0] > 0.1, drafts
    mine, theirs = policy_only(tr.named_weights()), dict(plain.named_weights())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert all(p.grad is None for p in tr.model.parameters())  # the head's loss reached no policy weight


def torch_engine():
    """The torch engine drafting with a head (from the plugin manager: a plugin's test imports no
    other plugin)."""
    from types import SimpleNamespace

    from miles.plugins import make_plugin_manager

    pm = make_plugin_manager()
    cfg = pm.registry("engines")["torch"].config.model_validate({"speculative": {"draft": "head", "tokens": 2}})
    tok = SimpleNamespace(eos_token_id=None, pad_token_id=0)
    return pm.create("engines", "torch", cfg, spec=Spec("qwen2", **SHARP), tokenizer=tok, seed=1)


def test_engine_receives_the_head_and_the_loss_is_the_hf_models(megatron_cpu):
    """The weights a sync sends reach the torch engine's drafting head and load strictly into a
    Hugging Face model with the head attached, where the head's loss (the fsdp2 path) is the one
    the megatron trainer computes."""
    from miles_draft.config import DraftConfig
    from miles_draft.head import attach, head_of
    from miles_draft.train import DraftTraining

    tr = make(HEAD)
    b = batch(rows=6, response=8)
    tr.train_step(b, loss_fn)  # the head moved from its initial weights
    named = dict(tr.named_weights())
    head = {k: v for k, v in named.items() if k.startswith("draft_head.")}
    assert head and all(torch.equal(v, tr.draft.head.state_dict()[k[len("draft_head."):]]) for k, v in head.items())
    assert not any(k.startswith("draft_head.") for k, _ in tr.model_weights())
    engine = torch_engine()  # the engine drafting with a head receives the head's weights with the policy's
    engine.load_weights(tr.named_weights(), version=1)
    theirs = head_of(engine.model).state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in tr.draft.head.state_dict().items())
    hf = Spec("qwen2", **SHARP).build_model(None)
    attach(hf)
    hf.load_state_dict(named, strict=True)
    want = DraftTraining(DraftConfig(**HEAD), hf).step(hf, b)
    got = tr.draft.step(tr, b)
    assert abs(got["draft_loss"] - want["draft_loss"]) < 1e-5 and abs(got["draft_top1"] - want["draft_top1"]) < 1e-6
    assert got["draft_loss"] > 0.1  # a head that has barely learned yet: the comparison is not of zeros
    other = make(HEAD, seed=5)  # load_weights takes the head's weights too
    other.load_weights(named.items())
    assert all(torch.equal(v, named[k]) for k, v in other.named_weights())


@pytest.mark.parametrize("vocab", [None, 32])
def test_checkpoint_round_trip_restores_the_head_and_its_optimizer(megatron_cpu, tmp_path, vocab):
    """With a reduced draft vocabulary (``draft.vocab``) its subset and counts come back too."""
    from miles_draft.files import load_head

    head = {**HEAD, "vocab": vocab}
    tr = make(head)
    b = batch(rows=6, response=8)
    m = tr.train_step(b, loss_fn)
    if vocab:
        assert 0 < m["draft_vocab_cover"] <= 1 and tr.draft.head.vocab_counts.sum() > 0
        assert tr.draft.head.subset().tolist() != list(range(vocab))  # it follows the counts
    tr.save(str(tmp_path / "ck"))
    tr.export_draft(str(tmp_path))  # draft_head.safetensors, as the engine reads it
    exported = tr.draft.head.fc.weight.detach().clone()
    again = make(head, seed=3)
    assert not torch.equal(again.draft.head.fc.weight, tr.draft.head.fc.weight)
    again.load(str(tmp_path / "ck"))
    for k, v in tr.draft.head.state_dict().items():
        assert torch.equal(again.draft.head.state_dict()[k], v), k
    m1, m2 = tr.train_step(b, loss_fn), again.train_step(b, loss_fn)
    assert untimed(m1) == untimed(m2)  # the AdamW moments and step of the head came back too
    assert all(torch.equal(v, dict(again.named_weights())[k]) for k, v in tr.named_weights())
    fresh = make(HEAD, seed=4).draft.head  # made without draft.vocab, as the engine's
    load_head(fresh, str(tmp_path))
    assert torch.equal(fresh.fc.weight, exported)
    assert torch.equal(fresh.draft_vocab, tr.draft.head.draft_vocab)


def test_config_accepts_mtp_and_refuses_pipeline_stages():
    from miles.config import resolve
    from miles.errors import ConfigError
    from miles.plugins import make_plugin_manager

    pm = make_plugin_manager()

    def load_config(data):
        return resolve(pm, data)

    base = {"model": {"name": "hf", "config": {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
                                               "num_hidden_layers": 2, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "vocab_size": 32}},
            "env": {"name": "arith"}, "engine": {"name": "torch", "speculative": {"draft": "head"}},
            "trainer": {"name": "megatron", "device": "cpu"}, "draft": {"train": True}}
    load_config(base)  # the head draft at pipeline_parallel 1: accepted
    mtp = {**base, "engine": {"name": "torch", "speculative": {"draft": "mtp"}}}
    load_config(mtp)  # a model's MTP layers: trained by this trainer too (test_mtp.py)
    for data in (base, mtp):
        with pytest.raises(ConfigError, match="draft.train: trainer megatron .*trainer.pipeline_parallel: 1"):
            load_config({**data, "trainer": {**data["trainer"], "pipeline_parallel": 2}})
    with pytest.raises(ConfigError, match="draft.lr"):
        load_config({**base, "draft": {"lr": -1}})
