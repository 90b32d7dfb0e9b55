"""R3 through `miles serve`: /generate's return_routed_experts from a real server process of a tiny
MoE folder, decoded by the sglang client into the samples the moe spec replays."""
import base64
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
from miles import Batch, SamplingParams, Sample, Task
from miles.testing import char_tokenizer

ROOT = Path(__file__).resolve().parents[4]
MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
       "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 3,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
       "initializer_range": 0.2}


def moe_spec(**base):
    from miles_plugin_moe.config import MoESpecConfig
    from miles_plugin_moe.spec import make_spec

    return make_spec(MoESpecConfig(base={"name": "hf", **base}))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A `miles serve` process of a tiny Qwen3-MoE folder (float32 engine, like the trainer)."""
    folder = tmp_path_factory.mktemp("moe") / "model"
    tok = char_tokenizer()
    torch.manual_seed(0)
    moe_spec(config=MOE).build_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    log = folder.parent / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(folder), "--port", "0"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(180)
    try:
        assert line and "listening on http://" in line[0], f"{line}; stderr:\n{log.read_text()[-3000:]}"
        yield folder, tok, "http://127.0.0.1:" + line[0].strip().rsplit(":", 1)[1]
    finally:
        proc.terminate()
        proc.wait(30)


def test_generate_returns_the_routed_experts_the_trainer_would_choose(served):
    from miles_plugin_moe.spec import routing_state

    folder, tok, url = served
    prompts = [tok("12+34=")["input_ids"], tok("5+7=")["input_ids"]]
    body = {"input_ids": prompts, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"n": 2, "max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3}}
    outs = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    assert len(outs) == 4
    spec = moe_spec(path=str(folder))
    model = spec.build_model(tok).eval()
    state = routing_state(model)
    for k, out in enumerate(outs):  # sample-major: prompts' first samples, then second samples
        prompt, meta = prompts[k % 2], out["meta_info"]
        ids = out["output_ids"]
        shape = meta["routed_experts_shape"]
        assert shape == [len(prompt) + len(ids) - 1, 3, 2]
        raw = base64.b64decode(meta["routed_experts"])
        rec = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(*shape)
        assert int(rec.min()) >= 0 and int(rec.max()) < 8
        # the same weights in the trainer's float32 forward route every token the same way
        with torch.no_grad(), state.recording():
            model(input_ids=torch.tensor([prompt + ids[:-1]]))
        assert torch.equal(state.take()[0], rec)
    dense = httpx.post(f"{url}/generate", json={**body, "return_routed_experts": False}, timeout=120).json()
    assert "routed_experts" not in dense[0]["meta_info"]


def test_sglang_client_hands_the_records_to_the_trainers_replay(served):
    from miles import make_plugin_manager
    from miles_plugin_sglang.config import SGLangEngineConfig

    folder, tok, url = served
    spec = moe_spec(path=str(folder))
    engine = make_plugin_manager().create("engines", "sglang", SGLangEngineConfig(urls=[url]), spec=spec,
                                          tokenizer=tok, seed=0)
    try:
        prompts = [tok("23+45=")["input_ids"], tok("9+9=")["input_ids"]]
        groups = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5), n=2)
    finally:
        engine.close()
    samples = [Sample(task=Task(prompt=""), prompt_ids=p, response_ids=c.token_ids, logprobs=c.logprobs,
                      loss_mask=[1] * len(c.token_ids), extensions=dict(c.extras))
               for p, g in zip(prompts, groups) for c in g]
    for s in samples:
        rec = s.extensions["moe"]["routed_experts"]
        assert rec.dtype == torch.int32 and tuple(rec.shape) == (len(s.prompt_ids) + len(s.response_ids) - 1, 3, 2)
    batch = Batch.from_samples(samples, tok.pad_token_id)
    model = spec.build_model(tok).eval()
    with torch.no_grad():
        lp = spec.action_logprobs(model, batch)
    m = batch.loss_mask.bool()
    assert (lp - batch.rollout_logprobs).abs()[m].max() < 1e-4
    # a wrong record changes the trainer's function: the replay really used the server's experts
    for s in samples:
        s.extensions["moe"]["routed_experts"] = (s.extensions["moe"]["routed_experts"] + 1) % 8
    with torch.no_grad():
        wrong = spec.action_logprobs(model, Batch.from_samples(samples, tok.pad_token_id))
    assert (wrong - batch.rollout_logprobs).abs()[m].max() > 1e-3


def test_a_dense_server_refuses_return_routed_experts():
    import asyncio

    from miles.testing import TinySpec
    from miles_plugin_torch_engine.config import TorchEngineConfig
    from miles_plugin_torch_engine.engine import TorchEngine
    from miles_plugin_torch_engine.scheduler import Scheduler
    from miles_plugin_torch_engine.server import build_app

    engine = TorchEngine(TorchEngineConfig(), spec=TinySpec(), tokenizer=char_tokenizer())
    scheduler = Scheduler(engine)
    app = build_app(engine, scheduler, model_dir="mem")

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/generate", json={"input_ids": [2, 5], "return_routed_experts": True})

    try:
        r = asyncio.run(post())
    finally:
        scheduler.stop()
    assert r.status_code == 400 and "return_routed_experts" in r.json()["error"]["message"]


def test_flat_records_and_resumed_pieces():
    """SGLang sends no shape (the spec reshapes by its model); a resumed piece keeps its first
    segment's rows and takes the rest from the resumed request's record."""
    from miles import Completion
    from miles_plugin_sglang.routing import attach, join_routed
    from miles_plugin_moe.spec import replay_table

    rec = torch.arange(5 * 3 * 2, dtype=torch.int32).view(5, 3, 2) % 8
    meta = {"routed_experts": base64.b64encode(rec.numpy().tobytes()).decode()}
    flat = attach(Completion([1, 2], [0.0, 0.0], "stop"), meta).extras["moe"]["routed_experts"]
    assert flat.shape == (30,)
    s = Sample(task=Task(prompt=""), prompt_ids=[3, 4, 5, 6], response_ids=[1, 2], logprobs=[0.0, 0.0],
               loss_mask=[1, 1], extensions={"moe": {"routed_experts": flat}})
    table = replay_table(Batch.from_samples([s], 0), 3, 2)
    assert torch.equal(table[0, :5], rec.long()) and bool((table[0, 5:] == -1).all())
    first = attach(Completion([1], [0.0], "abort"), {**meta, "routed_experts_shape": [5, 3, 2]})
    later = rec.clone()
    later[3:] = 7 - later[3:]  # rows the resumed request routed anew
    rest = attach(Completion([2], [0.0], "stop"),
                  {"routed_experts": base64.b64encode(torch.cat([later, later[-1:]]).numpy().tobytes()).decode(),
                   "routed_experts_shape": [6, 3, 2]})
    join_routed(first, rest, 1)
    got = first.extras["moe"]["routed_experts"]
    assert got.shape == (6, 3, 2) and torch.equal(got[:5], rec) and torch.equal(got[5], later[-1])
