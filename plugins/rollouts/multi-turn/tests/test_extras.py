"""Engine extras through multi-turn: an MoE model's routed experts (rollout routing replay, R3)
reach the sample as one record aligned with the one token sequence."""
import pytest
import torch
from miles import Batch, SamplingParams, Task
from miles.testing import char_tokenizer
from miles_plugin_multi_turn.config import MultiTurnConfig
from miles_plugin_multi_turn.extras import StitchedExtras
from miles_plugin_multi_turn.rollout import MultiTurnRollout

CALL = '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
       "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128, "tie_word_embeddings": True}


class EchoEnv:
    def tools(self):
        return [{"type": "function", "function": {"name": "echo", "parameters": {}}}]

    def call_tool(self, name, arguments, task):
        return arguments["text"] * 3


def _tokenizer():
    from tokenizers import AddedToken

    tok = char_tokenizer("0123456789+*=<>/_ abcdefghijklmnopqrstuvwxyz")
    tok.add_tokens([AddedToken(CALL, special=False, normalized=False)])
    return tok


def _moe(tok):
    """(spec, model): a tiny MoE whose one-token tool call scores as its likeliest token does
    (tied embeddings), so the random model calls the tool now and then."""
    pytest.importorskip("miles_plugin_moe")
    from miles_plugin_moe.config import MoESpecConfig
    from miles_plugin_moe.spec import make_spec

    spec = make_spec(MoESpecConfig(base={"name": "hf", "config": MOE}))
    torch.manual_seed(0)
    model = spec.build_model(tok)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        logits = model(input_ids=torch.tensor([tok.encode("1*1")])).logits[0, -1]
        emb[len(tok) - 1] = emb[int(logits[:-1].argmax())]
    return spec, model


def test_routed_experts_of_every_turn_become_one_record_the_trainer_replays():
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    tok = _tokenizer()
    spec, model = _moe(tok)
    engine = TorchEngine(TorchEngineConfig(), spec=spec, tokenizer=tok, seed=0)
    engine.load_weights(list(model.state_dict().items()), 1)
    _check_replay(spec, model, tok, engine)


@pytest.mark.slow
def test_routed_experts_through_miles_serve_and_the_sglang_client(tmp_path):
    """The same through HTTP: `miles serve` of the MoE folder returns each turn's routed experts
    (``return_routed_experts``), the sglang client decodes them, the rollout stitches them."""
    import os
    import subprocess
    import sys
    import threading

    from miles import make_plugin_manager

    tok = _tokenizer()
    spec, model = _moe(tok)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(folder), "--port", "0"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "serve.log", "w"), text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(180)
    engine = None
    try:
        assert line and "listening on http://" in line[0], (tmp_path / "serve.log").read_text()[-3000:]
        pm = make_plugin_manager()
        cfg = pm.registry("engines")["sglang"].config(urls=[line[0].strip().rsplit(" ", 1)[1]])
        engine = pm.create("engines", "sglang", cfg, spec=spec, tokenizer=tok, seed=0)
        _check_replay(spec, model, tok, engine)
    finally:
        if engine is not None:
            engine.close()
        proc.kill()
        proc.wait(30)


def _check_replay(spec, model, tok, engine):
    """Multi-turn samples carry one routed-experts record of their whole sequence, in the
    positions of its tokens, and replaying it reproduces the engine's log-probs."""
    from miles_plugin_moe.spec import routing_state

    ro = MultiTurnRollout(MultiTurnConfig(max_turns=3, max_total_tokens=96))
    params = SamplingParams(temperature=1.5, max_new_tokens=10, stop_token_ids=[tok.eos_token_id], seed=0)
    # 8 samples a task: about one in six calls the tool, so a draw with fewer than 3 is rare
    groups = ro.generate([Task(f"{a}*{a}") for a in range(6)], 8, engine=engine, env=EchoEnv(),
                         tokenizer=tok, params=params)
    samples = [s for g in groups for s in g]
    multi = [s for s in samples if s.extensions["multi_turn"]["turns"] > 1]
    assert len(multi) >= 3, "the random model calls its one-token tool now and then"
    for s in samples:
        rec = s.extensions["moe"]["routed_experts"]
        assert rec.dtype == torch.int32
        assert tuple(rec.shape) == (len(s.prompt_ids) + len(s.response_ids) - 1, 2, 2)
        if s.loss_mask[-1] == 1:  # ends on model tokens: every fed position has the experts it used
            assert (rec >= 0).all()

    batch = Batch.from_samples(samples, tok.pad_token_id)
    batch.temperature = params.temperature
    state = routing_state(model)
    with torch.no_grad(), state.recording():  # the trainer routing the whole sequences on its own
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    own = state.take()[0].view(len(batch), batch.input_ids.shape[1], 2, 2)
    for row, s in enumerate(samples):  # each row is the routing of the token in that position
        rec = s.extensions["moe"]["routed_experts"].long()
        start, kept = batch.prompt_len - len(s.prompt_ids), (rec >= 0).all(-1).all(-1)
        assert torch.equal(rec[kept].sort(-1).values, own[row, start:start + rec.shape[0]][kept].sort(-1).values)
    with torch.no_grad():  # replaying the stitched records reproduces the engine's log-probs
        lp = spec.action_logprobs(model, batch)
    mask = batch.loss_mask.bool()
    assert (lp - batch.rollout_logprobs)[mask].abs().max() < 1e-4


def test_stitching_keeps_the_first_forward_of_each_position_and_fills_unread_tool_tokens():
    ex = StitchedExtras()
    # turn 1: prompt of 3, generated 2 -> fed 4 positions; turn 2: its prompt is the 5 tokens so far
    # plus a 2-token tool frame (7), generated 3 (the budget keeps 2) -> fed 9 positions
    turn1 = torch.arange(4).view(4, 1)
    turn2 = torch.arange(100, 109).view(9, 1)
    ex.add({"moe": {"routed_experts": turn1, "note": "a"}}, prefix_len=3, generated=2, kept_len=5)
    ex.add({"moe": {"routed_experts": turn2, "note": "b"}}, prefix_len=7, generated=3, kept_len=9)
    out = ex.extensions(total_len=9 + 2)  # a final tool frame of 2 tokens no turn read
    rec = out["moe"]["routed_experts"]
    assert rec.view(-1).tolist() == [0, 1, 2, 3, 104, 105, 106, 107, -1, -1]
    assert out["moe"]["note"] == ["a", "b"]  # not per position: one entry per turn
    assert StitchedExtras().extensions(5) == {}


def test_a_flat_record_is_stitched_by_rows_and_handed_on_flat():
    """SGLang sends routed experts without a shape: ``fed x layers x top_k`` ids in one row."""
    ex = StitchedExtras()
    ex.add({"moe": {"routed_experts": torch.arange(8, dtype=torch.int32)}}, prefix_len=3, generated=2, kept_len=5)
    ex.add({"moe": {"routed_experts": torch.arange(100, 116, dtype=torch.int32)}}, prefix_len=7, generated=2,
           kept_len=9)
    rec = ex.extensions(total_len=9)["moe"]["routed_experts"]
    assert rec.dtype == torch.int32 and rec.dim() == 1
    assert rec.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 108, 109, 110, 111, 112, 113, 114, 115]
