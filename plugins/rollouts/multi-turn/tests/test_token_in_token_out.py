"""The trainer sees exactly the tokens and log-probs the engine produced; tool tokens are masked.

A real torch engine and a real fsdp2 trainer hold the same tiny random model. The tokenizer has
one token that is a whole, well-formed tool call, made as likely as the model's favourite token,
so the random model calls the tool now and then and trajectories of several turns occur without
any training.
"""
import torch
from miles import Batch, SamplingParams, Task
from miles.testing import TinySpec, char_tokenizer
from miles_plugin_fsdp2.config import FSDP2Config
from miles_plugin_fsdp2.trainer import FSDP2Trainer
from miles_plugin_multi_turn.config import MultiTurnConfig
from miles_plugin_multi_turn.rollout import MultiTurnRollout
from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine

CALL = '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'


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


def test_batch_holds_the_engine_ids_and_logprobs_and_masks_tool_tokens():
    tok, spec = _tokenizer(), TinySpec(hidden=32)
    trainer = FSDP2Trainer(FSDP2Config(), spec=spec, tokenizer=tok, seed=0, total_steps=1)
    with torch.no_grad():  # the call token scores as the model's likeliest next token does
        emb = trainer.model.get_input_embeddings().weight
        logits = trainer.model(input_ids=torch.tensor([tok.encode("1*1")])).logits[0, -1]
        emb[len(tok) - 1] = emb[int(logits[:-1].argmax())]
    engine = TorchEngine(TorchEngineConfig(), spec=spec, tokenizer=tok, seed=0)
    engine.load_weights(trainer.named_weights(), 1)
    seen = []  # (prompt, completion) of every engine call
    generate = engine.generate

    def spy(prompts, params, n=1):
        out = generate(prompts, params, n)
        seen.extend((list(p), c) for p, cs in zip(prompts, out) for c in cs)
        return out
    engine.generate = spy
    ro = MultiTurnRollout(MultiTurnConfig(max_turns=3, max_total_tokens=96))
    params = SamplingParams(temperature=1.5, max_new_tokens=12, stop_token_ids=[tok.eos_token_id], seed=0)
    groups = ro.generate([Task(f"{a}*{a}") for a in range(8)], 8, engine=engine, env=EchoEnv(),
                         tokenizer=tok, params=params)
    samples = [s for g in groups for s in g]
    frame = tok.encode("<tool_response>hihihi</tool_response>", add_special_tokens=False)
    multi = 0
    for s in samples:
        pos, turns = 0, 0
        while pos < len(s.response_ids):  # walk the sequence: engine turns and tool frames alternate
            if s.loss_mask[pos] == 0:
                assert s.response_ids[pos:pos + len(frame)] == frame[:len(s.response_ids) - pos]
                assert set(s.logprobs[pos:pos + len(frame)]) == {0.0}
                pos += len(frame)
                continue
            end = s.loss_mask.index(0, pos) if 0 in s.loss_mask[pos:] else len(s.loss_mask)
            run, prefix = s.response_ids[pos:end], s.prompt_ids + s.response_ids[:pos]
            # the engine completion for exactly this prefix (cut short only by the token budget)
            hits = [c for p, c in seen if p == prefix and c.token_ids[:len(run)] == run
                    and (len(c.token_ids) == len(run) or end == len(s.response_ids))]
            assert hits and s.logprobs[pos:end] == hits[0].logprobs[:len(run)]
            pos, turns = end, turns + 1
        assert turns == s.extensions["multi_turn"]["turns"]
        multi += turns > 1
    assert multi >= 4, "the random model calls its one-token tool now and then"

    batch = Batch.from_samples(samples, tok.pad_token_id)
    batch.temperature = params.temperature
    P = batch.prompt_len
    for i, s in enumerate(samples):
        r = len(s.response_ids)
        assert batch.input_ids[i, P:P + r].tolist() == s.response_ids
        assert batch.rollout_logprobs[i, :r].tolist() == s.logprobs
        assert batch.loss_mask[i, :r].tolist() == s.loss_mask
    # the trainer scores the engine's tokens in the same positions: its log-probs agree where trained
    lp = trainer.logprobs(batch)
    m = batch.loss_mask.bool()
    torch.testing.assert_close(lp[m], batch.rollout_logprobs[m], rtol=0, atol=2e-4)
