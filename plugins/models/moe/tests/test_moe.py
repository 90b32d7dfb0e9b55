"""MoE model spec with rollout routing replay: the engine records the experts, the trainer replays them."""
import pytest
import torch
from miles import Batch, MilesError, SamplingParams, Sample, Task

QWEN = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 32}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 32, "num_local_experts": 4,
           "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 32}


def tokenizer():
    from miles_plugin_arith.env import char_tokenizer

    return char_tokenizer()


def spec(config=QWEN, replay=True):
    from miles_plugin_moe.config import MoESpecConfig
    from miles_plugin_moe.spec import make_spec

    return make_spec(MoESpecConfig(base={"name": "hf", "config": config}, routing_replay=replay))


def rollout(config=QWEN, dtype="float32", seed=0, check_every=None, params=None):
    """(spec, engine, batch of 2 prompts x 2 samples with the engine's records and log-probs)."""
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine

    tok, s = tokenizer(), spec(config)
    torch.manual_seed(seed)
    engine = TorchEngine(TorchEngineConfig(dtype=dtype), spec=s, tokenizer=tok, seed=seed)
    engine.check_every = check_every or engine.check_every
    prompts = [tok("12+34=")["input_ids"], tok("5+7=")["input_ids"]]
    outs = engine.generate(prompts, params or SamplingParams(temperature=1.0, max_new_tokens=6), n=2)
    samples = [Sample(task=Task(prompt=""), prompt_ids=p, response_ids=c.token_ids, logprobs=c.logprobs,
                      loss_mask=[1] * len(c.token_ids), extensions=dict(c.extras))
               for p, cs in zip(prompts, outs) for c in cs]
    return s, engine, Batch.from_samples(samples, tok.pad_token_id)


def trainer_model(s, engine):
    """The trainer's copy: the same weights in float32."""
    model = s.build_model(tokenizer())
    model.load_state_dict({k: v.float() for k, v in engine.model.state_dict().items()})
    return model


@pytest.mark.parametrize("config", [QWEN, MIXTRAL], ids=["qwen3_moe", "mixtral"])
def test_records_match_the_trainers_routing_and_replay_reproduces_the_engine(config):
    from miles_plugin_moe.spec import routing_state

    s, engine, batch = rollout(config)
    for smp in batch.samples:  # every prompt token and every response token but the last
        rec = smp.extensions["moe"]["routed_experts"]
        assert rec.dtype == torch.int32
        assert tuple(rec.shape) == (len(smp.prompt_ids) + len(smp.response_ids) - 1, 2, 2)
    model = trainer_model(s, engine)
    state = routing_state(model)
    with torch.no_grad(), state.recording():  # the trainer routing on its own, same numerics
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    own = state.take()[0].view(len(batch), batch.input_ids.shape[1], 2, 2)
    for row, smp in enumerate(batch.samples):
        rec = smp.extensions["moe"]["routed_experts"]
        start = batch.prompt_len - len(smp.prompt_ids)
        # the same experts, as sets (top-k order can differ on near-ties)
        assert torch.equal(rec.sort(-1).values, own[row, start:start + rec.shape[0]].sort(-1).values)
    with torch.no_grad():
        lp = s.action_logprobs(model, batch)
    mask = batch.loss_mask.bool()
    assert (lp - batch.rollout_logprobs)[mask].abs().max() < 1e-4


def test_records_are_the_same_when_the_engine_reads_its_stop_flags_less_often():
    """On CUDA the engine looks at the rows' stop flags every few steps, so rows that stopped decode
    on: their tokens, log-probs and routing records are those of an engine that looks every step."""
    stops = [tokenizer()(c)["input_ids"][0] for c in "0123"]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=stops, seed=3)
    _, _, every = rollout(check_every=1, params=params)
    _, _, later = rollout(check_every=5, params=params)
    lengths = [len(smp.response_ids) for smp in every.samples]
    assert min(lengths) < max(lengths) and max(lengths) < 12, lengths  # rows stop early, at different steps
    for a, b in zip(every.samples, later.samples):
        assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
        assert torch.equal(a.extensions["moe"]["routed_experts"], b.extensions["moe"]["routed_experts"])


def test_a_wrong_replay_changes_the_output():
    s, engine, batch = rollout()
    model = trainer_model(s, engine)
    with torch.no_grad():
        right = s.action_logprobs(model, batch)
        for smp in batch.samples:  # every token sent to the next experts instead
            rec = smp.extensions["moe"]["routed_experts"]
            smp.extensions["moe"]["routed_experts"] = (rec + 1) % 8
        wrong = s.action_logprobs(model, batch)
    mask = batch.loss_mask.bool()
    assert (right - wrong)[mask].abs().max() > 1e-3


def test_gradients_reach_the_router_under_replay():
    s, engine, batch = rollout()
    model = trainer_model(s, engine)
    s.action_logprobs(model, batch)[batch.loss_mask.bool()].sum().backward()
    gates = [m.weight for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert len(gates) == 2 and all(g.grad is not None and g.grad.abs().sum() > 0 for g in gates)
    # the routers keep their Hugging Face parameter names
    assert "model.layers.0.mlp.gate.weight" in dict(model.named_parameters())


def test_replay_off_routes_as_usual_and_records_nothing():
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine
    from miles.protocols import RecordsRouting, ScoresActions

    s = spec(replay=False)
    assert not isinstance(s, RecordsRouting) and not isinstance(s, ScoresActions)
    tok = tokenizer()
    engine = TorchEngine(TorchEngineConfig(), spec=s, tokenizer=tok)
    out = engine.generate([tok("1+1=")["input_ids"]], SamplingParams(max_new_tokens=2))
    assert out[0][0].extras == {}


def test_a_dense_base_model_is_a_clear_error():
    dense = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
    with pytest.raises(MilesError, match="qwen3_moe or mixtral"):
        spec(dense).build_model(tokenizer())
