"""An online-trained draft reaches the engines with the policy, through every weight transport.

One RL step of the fsdp2 trainer with ``draft.train: true`` changes the draft (an EAGLE-style head,
``draft_head.*``, or a DeepSeek-V3 model's MTP layer); after the loop's weight push the engine
drafts with exactly the trainer's new draft weights. Each transport is checked into the run's
in-process torch engine (as the loop pushes) and into a ``miles serve`` process (a disaggregated
run's engine, written through the same transport's remote path: shared memory, a gloo group, a
folder, NIXL writes); ``p2p`` writes only into engine processes.
"""
from __future__ import annotations

from pathlib import Path

import miles_wire as W
import pytest
import torch
from miles.cli import load
from miles.loop import Loop, initial_model
from miles.testing import server_url, start_server
from miles_draft import PREFIX
from miles_mtp import mtp_layers

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny.yaml")
TRANSPORTS = ["tensor", "broadcast", "disk", "p2p"]
DRAFT = ["loggers=[]", "algorithm.filter_zero_variance=false", "draft.train=true", "draft.lr=3.0e-3"]
HEAD = "{draft: head, tokens: 2}"
# a reduced draft vocabulary: its subset and counts travel as two more of the head's tensors, into
# engines (miles serve's too) that made their head without the draft: section
VOCAB = ["model.config.vocab_size=32", "draft.vocab=16"]
# a tiny DeepSeek-V3 (one dense layer, one MoE layer) with one MTP layer: model.layers.2.*
DSV3 = ("{model_type: deepseek_v3, hidden_size: 32, intermediate_size: 64, moe_intermediate_size: 16, "
        "num_hidden_layers: 2, first_k_dense_replace: 1, num_attention_heads: 2, num_key_value_heads: 2, "
        "n_routed_experts: 4, n_group: 1, topk_group: 1, num_experts_per_tok: 2, kv_lora_rank: 16, "
        "q_lora_rank: 16, qk_rope_head_dim: 8, qk_nope_head_dim: 8, v_head_dim: 8, "
        "num_nextn_predict_layers: 1, max_position_embeddings: 32}")
MTP = "model.layers.2."


def make_loop(out: Path, *overrides: str) -> Loop:
    """A run's components (in-process torch engine, fsdp2 trainer) as ``miles train`` builds them."""
    pm, cfg = load(TINY, [f"run.out_dir={out}", *DRAFT, *overrides], [])
    loop = Loop(pm, cfg)
    loop.build()
    loop.new_trainer()
    return loop


class Server:
    """A ``miles serve`` process drafting with a head, started at once and waited for on first use
    (it boots while the in-process checks run)."""

    def __init__(self, folder: Path):
        self.log = folder.parent / "serve.log"
        self.proc = start_server(folder, self.log, f"speculative={HEAD}")
        self._engine = None

    def engine(self):
        if self._engine is None:
            from miles import make_plugin_manager

            pm = make_plugin_manager()
            url = server_url(self.proc, self.log)
            self._engine = pm.create("engines", "sglang", pm.registry("engines")["sglang"].config(urls=[url]),
                                     spec=None, tokenizer=None, seed=0)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("served")
    pm, cfg = load(TINY, [f"run.out_dir={out / 'run'}", *DRAFT, *VOCAB, f"engine.speculative={HEAD}"], [])
    initial_model(pm, cfg, str(out / "model"))  # the run's architecture; its head starts at random
    s = Server(out / "model")
    yield s
    s.close()


def weights(loop: Loop, prefix: str) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in loop.components.trainer.named_weights() if n.startswith(prefix)}


def drafting(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors the engine's drafter computes with, under the trainer's names."""
    return {prefix + n: t.clone() for n, t in module.state_dict().items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    wrong = [n for n in want if not torch.equal(got[n], want[n])]
    assert not wrong, f"the engine's {wrong} differ from the trainer's"


def close(loop: Loop, *transports) -> None:
    """Leave broadcast groups, unlink shared memory, stop NIXL agents (disk keeps nothing open)."""
    loop.mode.close()
    for t in (loop.components.transport, *transports):
        if hasattr(t, "close"):
            t.close()


@pytest.mark.parametrize("name", TRANSPORTS)
def test_trained_head_reaches_the_engines_bit_for_bit(name, server, tmp_path):
    # p2p refuses an in-process engine: the run's own engine then takes the tensor transport
    loop = make_loop(tmp_path / "run", f"engine.speculative={HEAD}", *VOCAB,
                     f"transport.name={'tensor' if name == 'p2p' else name}")
    c, pm = loop.components, loop.pm
    remote = pm.create("transports", name, pm.registry("transports")[name].config(), out_dir=str(tmp_path / "remote"))
    head = c.engine._spec.drafter.head  # the module the engine drafts with
    try:
        loop.sync()  # version 0, as a run pushes before its first step
        client = server.engine()
        remote.sync(c.trainer, [client], loop.version)
        before = weights(loop, PREFIX)
        # fc, attn_norm, qkv, o, mlp_norm, gate_up, down, norm; draft_vocab, vocab_counts
        assert len(before) == 10 and int((before[PREFIX + "draft_vocab"] >= 0).sum()) == 16
        assert client.weight_checksums(list(before)) == {n: W.checksum(t) for n, t in before.items()}
        if name != "p2p":
            assert_same(drafting(head, PREFIX), before)

        m = loop.rl_step(1)  # rollout (drafting with the head), policy and draft updates, push
        remote.sync(c.trainer, [client], loop.version)
        after = weights(loop, PREFIX)
        assert sorted(after) == sorted(before)
        assert m["draft_loss"] > 0 and m["weight_version"] == 1
        # the step trained every tensor, and its rollouts' tokens moved the counts and the subset
        assert [n for n in after if torch.equal(after[n], before[n])] == []
        if name != "p2p":
            assert_same(drafting(head, PREFIX), after)
            assert c.engine.weight_version == 1
        assert client.weight_checksums(list(after)) == {n: W.checksum(t) for n, t in after.items()}
        assert client.weight_version == 1
    finally:
        close(loop, remote)


@pytest.mark.parametrize("name", ["tensor", "broadcast", "disk"])
def test_trained_mtp_layer_reaches_the_engine_bit_for_bit(name, tmp_path):
    loop = make_loop(tmp_path / "run", f"model.config={DSV3}", "engine.speculative={draft: mtp, tokens: 2}",
                     f"transport.name={name}")
    c = loop.components
    (layer,) = mtp_layers(c.engine.model)  # the layer the engine drafts with
    try:
        loop.sync()
        before = weights(loop, MTP)
        assert MTP + "eh_proj.weight" in before
        assert_same(drafting(layer, MTP), before)

        loop.rl_step(1)
        after = weights(loop, MTP)
        assert sorted(after) == sorted(before)
        trained = [n for n in after if not torch.equal(after[n], before[n])]
        assert MTP + "eh_proj.weight" in trained and MTP + "mlp.gate.weight" in trained
        assert_same(drafting(layer, MTP), after)
        assert c.engine.weight_version == 1
    finally:
        close(loop)
