"""The official ``openai`` client against real ``miles serve`` processes (OpenAI-compatible routes).

The model is a tiny Qwen2 trained for a few seconds to answer one chat prompt with a Hermes-style
tool call, so tool-call parsing is checked on what the engine really generates."""
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from miles.testing import char_tokenizer, fit_answers, server_url, start_server

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-openai-key"
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz[]{}<>/\":,;_=.!?'"
TEMPLATE = ("{% if tools %}[tools]{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
            "{% for m in messages %}[{{ m.role }}]{% if m.content %}{{ m.content }}{% endif %}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
            "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
QUESTION = [{"role": "user", "content": "what_is_2_plus_3?"}]
CALL = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'


def tokenizer():
    tok = char_tokenizer(CHARS)
    tok.chat_template = TEMPLATE
    return tok


def random_model(tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))


def train_tool_caller(tok):
    """A tiny causal LM that answers QUESTION (with TOOLS) by CALL, then EOS (~5 s on one core).
    Test texts have no spaces: saved next to a Qwen2 config, this character tokenizer loads back
    as a Qwen2 tokenizer whose byte-level pre-tokenizer drops them."""
    prompt = tok.encode(tok.apply_chat_template(QUESTION, tools=TOOLS, tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    ids = prompt + tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    return fit_answers(random_model(tok), [(ids, len(prompt))], tok.pad_token_id, decay=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Two servers: the tool caller with a chat template and an API key, and a random model
    without a chat template (and without a key, on loopback)."""
    base = tmp_path_factory.mktemp("openai")
    tok = tokenizer()
    # the keyless server (random weights) starts while the other model trains
    random_model(tok).save_pretrained(base / "plain")
    tok.save_pretrained(base / "plain")
    (base / "plain" / "chat_template.jinja").unlink()
    config = json.loads((base / "plain" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "plain" / "tokenizer_config.json").write_text(json.dumps(config))
    procs = [start_server(base / "plain", base / "b.log")]
    try:
        model = train_tool_caller(tok)
        model.save_pretrained(base / "model")
        tok.save_pretrained(base / "model")
        procs.insert(0, start_server(base / "model", base / "a.log", "--api-key", KEY))
        urls = [server_url(p, base / f"{n}.log", 120) for p, n in zip(procs, "ab")]
        yield {"url": urls[0], "plain_url": urls[1], "model_dir": base / "model", "tok": tok, "model": model}
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


def client(served, key=KEY):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key=key, max_retries=0, timeout=60)


def model_id(served):
    return client(served).models.list().data[0].id


def test_models_lists_the_served_folder(served):
    models = client(served).models.list().data
    assert [m.id for m in models] == [str(served["model_dir"])] and models[0].owned_by == "miles"


def test_chat_tool_call_in_openai_format_with_token_ids(served):
    tok = served["tok"]
    r = client(served).chat.completions.create(model=model_id(served), messages=QUESTION, tools=TOOLS,
                                               temperature=0, max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    # the token-level data an RL trainer keeps: exactly what the engine generated, and the prompt
    extra = choice.model_extra
    assert tok.decode(extra["token_ids"]) == CALL + tok.eos_token and extra["weight_version"] == 0
    want_prompt = tok.encode(tok.apply_chat_template(QUESTION, tools=TOOLS, tokenize=False,
                                                     add_generation_prompt=True), add_special_tokens=False)
    assert extra["prompt_token_ids"] == want_prompt == r.model_extra["prompt_token_ids"]
    assert r.usage.prompt_tokens == len(want_prompt) and r.usage.completion_tokens == len(extra["token_ids"])
    # tool_choice "none": the same text comes back as content, unparsed
    plain = client(served).chat.completions.create(model=model_id(served), messages=QUESTION, tools=TOOLS,
                                                   tool_choice="none", temperature=0, max_tokens=100)
    assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"
    # a tool result in the conversation renders through the template (arguments as an object)
    follow = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r2 = client(served).chat.completions.create(model=model_id(served), messages=follow, tools=TOOLS,
                                                max_tokens=3, seed=1)
    rendered = tok.decode(r2.choices[0].model_extra["prompt_token_ids"]).replace(" ", "")
    assert rendered.endswith("</tool_call>[tool]5[assistant]") and "\\" not in rendered
    assert '"arguments":{"a":2,"b":3}' in rendered


def test_streaming_chat_matches_the_full_answer(served):
    c, mid = client(served), model_id(served)
    full = c.chat.completions.create(model=mid, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                     temperature=0, max_tokens=100)
    chunks = list(c.chat.completions.create(model=mid, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=100, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]
    assert text == CALL and ids == full.choices[0].model_extra["token_ids"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(ids) and chunks[0].choices[0].delta.role == "assistant"
    tools = list(c.chat.completions.create(model=mid, messages=QUESTION, tools=TOOLS, temperature=0,
                                           max_tokens=100, stream=True))
    calls = [tc for ch in tools for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "add" and calls[0].index == 0
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
    assert tools[-1].choices[0].finish_reason == "tool_calls"


def local_logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1)


def test_completion_logprobs_are_the_models(served):
    tok, model = served["tok"], served["model"]
    r = client(served).completions.create(model=model_id(served), prompt="[user]hi_there", max_tokens=8,
                                          temperature=0.7, seed=3, logprobs=3)
    choice = r.choices[0]
    ids, prompt = choice.model_extra["token_ids"], choice.model_extra["prompt_token_ids"]
    assert prompt == tok.encode("[user]hi_there") and len(ids) == r.usage.completion_tokens > 0
    want = local_logprobs(model, prompt, ids, 0.7)
    got = torch.tensor(choice.logprobs.token_logprobs)
    assert torch.allclose(got, want.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1), atol=1e-4)
    assert choice.logprobs.tokens == [tok.decode([t]) for t in ids]
    for row, top in zip(want, choice.logprobs.top_logprobs):
        vals, idx = row.topk(3)
        assert list(top) == [tok.decode([i]) for i in idx.tolist()]
        assert torch.allclose(torch.tensor(list(top.values())), vals, atol=1e-4)
    again = client(served).completions.create(model=model_id(served), prompt="[user]hi_there", max_tokens=8,
                                              temperature=0.7, seed=3)
    assert again.choices[0].model_extra["token_ids"] == ids  # a seed reproduces the draw


def test_chat_logprobs_and_stream_logprobs(served):
    c, mid = client(served), model_id(served)
    r = c.chat.completions.create(model=mid, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=100,
                                  logprobs=True, top_logprobs=2)
    entries, ids = r.choices[0].logprobs.content, r.choices[0].model_extra["token_ids"]
    assert len(entries) == len(ids) and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.token == e.top_logprobs[0].token and abs(e.logprob - e.top_logprobs[0].logprob) < 1e-4
               for e in entries)  # greedy: the chosen token is the likeliest
    assert max(e.logprob for e in entries) <= 0 and bytes(entries[0].bytes).decode() == entries[0].token
    chunks = list(c.completions.create(model=mid, prompt="[user]hey", max_tokens=5, logprobs=1, stream=True, seed=0))
    lps = [lp for ch in chunks for lp in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])]
    assert len(lps) == sum(len(ch.choices[0].model_extra["token_ids"]) for ch in chunks) == 5


def test_completion_batches_n_stop_and_length(served):
    c, mid, tok = client(served), model_id(served), served["tok"]
    r = c.completions.create(model=mid, prompt=["[user]ab", "[user]cd"], n=2, max_tokens=4, seed=5)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 2 * len(tok.encode("[user]ab"))  # each prompt once, not per choice
    assert [ch.model_extra["prompt_token_ids"] for ch in r.choices] == \
        [tok.encode(p) for p in ["[user]ab"] * 2 + ["[user]cd"] * 2]
    for ch in r.choices:
        assert ch.text == tok.decode(ch.model_extra["token_ids"], skip_special_tokens=True)
    prompt = tok.apply_chat_template(QUESTION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    stopped = c.completions.create(model=mid, prompt=prompt, temperature=0, max_tokens=100, stop=['"arguments'])
    ch = stopped.choices[0]
    assert ch.text == '<tool_call>{"name":"add",' and ch.finish_reason == "stop"
    assert tok.decode(ch.model_extra["token_ids"]) == '<tool_call>{"name":"add","arguments'
    short = c.completions.create(model=mid, prompt=prompt, temperature=0, max_tokens=5)
    assert short.choices[0].text == "<tool" and short.choices[0].finish_reason == "length"


def test_auth_is_required_and_compared(served):
    with pytest.raises(openai.AuthenticationError):
        client(served, key="wrong").models.list()
    unauthorized = httpx.post(served["url"] + "/v1/chat/completions", json={"messages": QUESTION}, timeout=10)
    assert unauthorized.status_code == 401
    # the keyless loopback server answers without one
    plain = openai.OpenAI(base_url=served["plain_url"] + "/v1", api_key="unused", max_retries=0)
    assert plain.models.list().data


def test_bad_input_is_a_json_4xx(served):
    c, mid = client(served), model_id(served)
    cases = [dict(messages=QUESTION, temperature=5.0), dict(messages=[]),
             dict(messages=QUESTION, presence_penalty=1.0), dict(messages=QUESTION, max_tokens=10_000),
             dict(messages=QUESTION, tools=TOOLS, tool_choice="required"),
             dict(messages=QUESTION, logprobs=False, top_logprobs=2)]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=mid, **kw)
        assert err.value.status_code == 400 and err.value.body["message"], kw
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.chat.completions.create(model="gpt-4o", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="no room to generate"):
        c.completions.create(model=mid, prompt=[3] * 300)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        c.completions.create(model=mid, prompt=[2, 99999])
    plain = openai.OpenAI(base_url=served["plain_url"] + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        plain.chat.completions.create(model="plain", messages=QUESTION)
    raw = httpx.post(served["url"] + "/v1/completions", content=b"{not json", timeout=10,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"


def test_tool_call_parsing_good_malformed_and_several():
    from miles_plugin_torch_engine.tool_calls import parse_tool_calls

    content, calls = parse_tool_calls('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
                                      '<tool_call>\n{"name": "mul", "arguments": "{\\"x\\": 2}"}\n</tool_call>')
    assert content == "Let me add." and [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"x": 2}]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    # cut off before the closing tag (generation ended): still a call when the JSON is whole
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')[1][0]["function"]["arguments"] == "{}"
    for bad in ('<tool_call>{"name": "f", "arguments": {</tool_call>', "<tool_call>[1, 2]</tool_call>",
                '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f"}</tool_call><tool_call>oops'):
        assert parse_tool_calls(bad) == (bad, [])  # malformed: the text stays the answer
    assert parse_tool_calls("no calls here") == ("no calls here", [])
