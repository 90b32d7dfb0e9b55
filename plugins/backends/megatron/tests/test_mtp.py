"""A model's MTP layers trained online by the megatron trainer (a ``draft:`` section on a model that
carries them): the loss and step are the fsdp2 trainer's (``miles_mtp.train.MTPTraining`` on the
Hugging Face model), the layer learns, its weights leave and come back in the checkpoint's own
names bit for bit, and a megatron checkpoint brings back the layer and its optimizer."""
import pytest
import torch
from frontier import GATED, Spec, architecture, hf_model
from helpers import batch
from miles import MilesError
from miles_mtp import mtp_layers
from miles_plugin_megatron.config import MegatronConfig
from miles_telemetry import untimed

MTP = {"train": True, "lr": 1e-2}
NAMES = {"deepseek_v3": "model.layers.3.", "glm_moe_dsa": "model.layers.3.", "qwen3_next": "mtp."}  # checkpoint names


class MTPSpec(Spec):
    """frontier's spec, with Qwen3-Next's MTP block declared and attached, as the hf spec attaches it."""

    def build_model(self, tokenizer):
        return hf_mtp(self.family)


def hf_mtp(family):
    if family not in GATED:
        return hf_model(family).train()
    model = hf_model(family, mtp_num_hidden_layers=1).train()
    architecture(family).attach_mtp(model, None)
    return model


def make(family="deepseek_v3", draft=MTP, seed=0, **cfg):
    from miles_plugin_megatron.trainer import MegatronTrainer

    cfg = MegatronConfig(device="cpu", precision="fp32", **{"lr": 1e-4, **cfg})
    return MegatronTrainer(cfg, spec=MTPSpec(family), tokenizer=None, seed=seed, total_steps=10, draft=draft)


def loss_fn(mb, lp):
    return -mb.token_mean(lp * mb.advantages), {}


def mtp_of(named, family="deepseek_v3"):
    return {k: v.clone() for k, v in named if k.startswith(NAMES[family])}  # copies: the layer's are live


def torch_engine():
    """The torch engine drafting with the MTP layer (from the plugin manager: a plugin's test
    imports no other plugin)."""
    from types import SimpleNamespace

    from miles.plugins import make_plugin_manager

    pm = make_plugin_manager()
    cfg = pm.registry("engines")["torch"].config.model_validate({"speculative": {"draft": "mtp", "tokens": 2}})
    tok = SimpleNamespace(eos_token_id=None, pad_token_id=0)
    return pm.create("engines", "torch", cfg, spec=MTPSpec("deepseek_v3"), tokenizer=tok, seed=1)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next", "glm_moe_dsa"])
def test_loss_and_step_are_the_fsdp2_trainers(megatron_cpu, family):
    """On the same weights and batch the megatron trainer's MTP loss is the one the fsdp2 trainer's
    MTPTraining computes on the Hugging Face model, and so is the loss after each one's step."""
    from miles_draft.config import DraftConfig
    from miles_mtp.train import MTPTraining

    tr = make(family)
    named = dict(tr.named_weights())
    hf = hf_mtp(family)
    hf.load_state_dict(named, strict=True)  # the trained layer's names are the checkpoint's
    ref = MTPTraining(DraftConfig(**MTP), hf)
    b = batch(rows=6, response=8)
    for _ in range(2):
        got = tr.train_step(b, loss_fn)  # the policy's step, then the MTP layer's on the updated policy
        hf.load_state_dict({k: v for k, v in tr.named_weights() if k not in mtp_of(named.items(), family)},
                           strict=False)  # the same updated policy under the fsdp2 trainer's MTPTraining
        want = ref.step(hf, b)
        assert abs(got["mtp_loss"] - want["mtp_loss"]) < 1e-5, (got, want)
        assert abs(got["mtp_top1"] - want["mtp_top1"]) < 1e-6
        assert got["mtp_loss"] > 1.0  # an untrained layer: the comparison is not of zeros


def test_layer_learns_and_the_policy_update_is_unchanged(megatron_cpu):
    tr, plain = make(), make(draft=None)
    b = batch(rows=6, response=8)
    losses = []
    for _ in range(5):
        m, want = tr.train_step(b, loss_fn), plain.train_step(b, loss_fn)
        losses.append(m.pop("mtp_loss"))
        assert 0 <= m.pop("mtp_top1") <= 1
        assert untimed(m) == untimed(want)  # the layer's training leaves the policy's step alone
    print(f"MEASURED deepseek_v3 mtp_loss over 5 steps: {[round(x, 3) for x in losses]}")
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(p.grad is None for p in tr.model.parameters())  # its loss reached no policy weight
    mine = {k: v for k, v in tr.named_weights() if not k.startswith(NAMES["deepseek_v3"])}
    assert all(torch.equal(v, mine[k]) for k, v in plain.named_weights() if k in mine)


def test_named_weights_round_trip_and_export(megatron_cpu, tmp_path):
    """The MTP layer's weights leave as the Hugging Face model's (bit for bit), move with a step,
    go into another trainer through load_weights and into the export under the same names."""
    tr = make()
    start = mtp_of(tr.named_weights())
    hf = mtp_of(hf_model("deepseek_v3").state_dict().items())
    assert start.keys() == hf.keys() and "model.layers.3.eh_proj.weight" in hf
    assert all(torch.equal(start[k], v) for k, v in hf.items())
    tr.train_step(batch(rows=6, response=8), loss_fn)
    moved = mtp_of(tr.named_weights())
    assert not torch.equal(moved["model.layers.3.eh_proj.weight"], start["model.layers.3.eh_proj.weight"])
    assert mtp_of(tr.model_weights()).keys() == moved.keys()  # miles export writes them in these names
    tr.export_draft(str(tmp_path))
    assert not any(tmp_path.iterdir())  # no draft head file: the layer is the model's
    engine = torch_engine()  # the engine drafting with the model's MTP layer receives it with the policy
    engine.load_weights(tr.named_weights(), version=1)
    drafting = mtp_layers(engine.model)[0].state_dict()
    assert all(torch.equal(drafting[k], v) for k, v in tr.draft.layer.state_dict().items())
    other = make(seed=5)
    other.load_weights(tr.named_weights())
    assert all(torch.equal(v, moved[k]) for k, v in mtp_of(other.named_weights()).items())
    with pytest.raises(MilesError, match="missing weights.*model.layers.3"):
        other.load_weights((k, v) for k, v in tr.named_weights() if k != "model.layers.3.eh_proj.weight")


def test_checkpoint_restores_the_layer_and_its_optimizer(megatron_cpu, tmp_path):
    tr = make()
    b = batch(rows=6, response=8)
    tr.train_step(b, loss_fn)
    tr.save(str(tmp_path / "ck"))
    again = make()  # the layer as the model's weights gave it, no moments
    assert not torch.equal(again.draft.layer.eh_proj.weight, tr.draft.layer.eh_proj.weight)
    again.load(str(tmp_path / "ck"))
    for k, v in tr.draft.layer.state_dict().items():
        assert torch.equal(again.draft.layer.state_dict()[k], v), k
    pairs = list(zip(tr.draft.layer.parameters(), again.draft.layer.parameters()))
    stepped = [(p, q) for p, q in pairs if tr.draft.optim.state.get(p)]
    assert stepped
    for p, q in stepped:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(tr.draft.optim.state[p][k], again.draft.optim.state[q][k]), k
    m1, m2 = tr.train_step(b, loss_fn), again.train_step(b, loss_fn)
    assert untimed(m1) == untimed(m2)
    assert all(torch.equal(v, dict(again.named_weights())[k]) for k, v in tr.named_weights())
