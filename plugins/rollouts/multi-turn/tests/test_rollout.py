import pytest
from miles import Completion, MilesError, SamplingParams, Task
from miles.types import Status
from miles_plugin_multi_turn.config import MultiTurnConfig
from miles_plugin_multi_turn.rollout import MultiTurnRollout

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=400, seed=1)


def call(expr: str, name: str = "calc") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"expression": "{expr}"}}}}</tool_call>'


class ScriptedEngine:
    """Answers turn ``k`` of a trajectory (``k`` = EOS tokens in its prompt) with ``script(k, prompt)``
    plus EOS; every token gets its own distinct log-prob, so a copy in the wrong place shows."""

    def __init__(self, tokenizer, script, version: int = 7):
        self.tok, self.script, self.weight_version = tokenizer, script, version
        self.calls: list[tuple[int, int]] = []  # (prompts, n) per generate call
        self.outputs: list[tuple[list[int], Completion]] = []
        self._next = 0

    def generate(self, prompts, params, n=1):
        self.calls.append((len(prompts), n))
        out = []
        for p in prompts:
            turn = list(p).count(self.tok.eos_token_id)
            ids = self.tok.encode(self.script(turn, p), add_special_tokens=False) + [self.tok.eos_token_id]
            comps = []
            for _ in range(n):
                lps = [-(self._next + i + 1) / 1000 for i in range(len(ids))]
                self._next += len(ids)
                k = min(len(ids), params.max_new_tokens)
                c = Completion(ids[:k], lps[:k], "stop" if k == len(ids) else "length", self.weight_version)
                self.outputs.append((list(p), c))
                comps.append(c)
            out.append(comps)
        return out

    def load_weights(self, named, version):
        self.weight_version = version


class CalcEnv:
    """Offers one tool, ``calc``; raises on an expression it cannot evaluate."""

    def __init__(self):
        self.seen: list[tuple[str, dict, str]] = []

    def tasks(self, split):
        return [Task("2*3", label="6"), Task("4*5", label="20")]

    def reward(self, sample):
        return 0.0

    def tools(self):
        return [{"type": "function", "function": {"name": "calc", "parameters": {
            "type": "object", "properties": {"expression": {"type": "string"}}}}}]

    def call_tool(self, name, arguments, task):
        self.seen.append((name, arguments, task.id))
        if name != "calc":
            raise ValueError(f"no tool {name}")
        expr = arguments["expression"]
        if not all(c in "0123456789+-*" for c in expr):
            raise ValueError("bad expression")
        return str(eval(expr))  # digits and + - * only (checked above)


def _run(tok, script, tasks=None, n=2, **cfg):
    engine, env = ScriptedEngine(tok, script), CalcEnv()
    ro = MultiTurnRollout(MultiTurnConfig(**cfg))
    groups = ro.generate(tasks or env.tasks("train"), n, engine=engine, env=env, tokenizer=tok, params=PARAMS)
    return groups, engine, env, ro


def _runs(mask):
    """(start, end, value) of each maximal run of equal loss-mask entries."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def test_tool_call_then_answer_is_one_sequence_with_engine_tokens_and_masked_tool_output(tok):
    groups, engine, env, ro = _run(tok, lambda k, p: call("2*3") if k == 0 else "=6")
    assert [len(g) for g in groups] == [2, 2] and engine.calls == [(2, 2), (4, 1)]  # batched turns
    for g in groups:
        for s in g:
            assert s.status == Status.COMPLETED and s.weight_versions == [7] and s.weight_version == 7
            assert len(s.response_ids) == len(s.logprobs) == len(s.loss_mask)
            frame = tok.encode("<tool_response>6</tool_response>", add_special_tokens=False)
            (a, b, m1), (c, d, m0), (e, f, m2) = _runs(s.loss_mask)
            assert (m1, m0, m2) == (1, 0, 1) and s.response_ids[c:d] == frame
            assert all(lp == 0.0 for lp in s.logprobs[c:d])
            # every model run is exactly one engine completion for exactly this prefix
            for start, end in ((a, b), (e, f)):
                prefix = s.prompt_ids + s.response_ids[:start]
                hits = [c for p, c in engine.outputs if p == prefix and c.token_ids == s.response_ids[start:end]
                        and c.logprobs == s.logprobs[start:end]]
                assert len(hits) == 1
            ext = s.extensions["multi_turn"]
            assert ext == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "truncated": False, "final_response": "=6",
                           "messages": [{"role": "assistant", "content": call("2*3")},
                                        {"role": "tool", "content": "6"}, {"role": "assistant", "content": "=6"}]}
    assert env.seen == [("calc", {"expression": "2*3"}, groups[0][0].task.id)] * 2 + \
        [("calc", {"expression": "2*3"}, groups[1][0].task.id)] * 2
    assert ro.metrics([s for g in groups for s in g]) == {"turns_mean": 2.0, "tool_calls_mean": 1.0,
                                                         "tool_errors": 0.0, "truncated_frac": 0.0}


def test_several_calls_in_a_turn_and_every_kind_of_tool_error(tok):
    turn0 = call("2*3") + call("1+1", name="nope") + call("x") + '<tool_call>{"name": oops}</tool_call>'
    groups, *_ = _run(tok, lambda k, p: turn0 if k == 0 else "=6", n=1)
    s = groups[0][0]
    (_, _, _), (c, d, m0), _ = _runs(s.loss_mask)
    assert m0 == 0
    text = tok.decode(s.response_ids[c:d])
    assert text == ("<tool_response>6</tool_response><tool_response>error: no tool nope</tool_response>"
                    "<tool_response>error: bad expression</tool_response>"
                    "<tool_response>error: invalid JSON in tool call</tool_response>")
    assert s.extensions["multi_turn"]["tool_calls"] == 4 and s.extensions["multi_turn"]["tool_errors"] == 3


def test_max_turns_ends_a_sample_that_keeps_calling_tools_truncated(tok):
    groups, engine, _, ro = _run(tok, lambda k, p: call("1+1"), max_turns=3)
    s = groups[0][0]
    ext = s.extensions["multi_turn"]
    assert s.status == Status.TRUNCATED and ext["turns"] == 3 and ext["tool_calls"] == 3 and ext["truncated"]
    assert [m for _, _, m in _runs(s.loss_mask)] == [1, 0, 1, 0, 1]  # no tool output after the last turn
    assert len(engine.calls) == 3
    assert ro.metrics(groups[0])["truncated_frac"] == 1.0


def test_token_budget_cuts_model_and_tool_tokens_and_never_exceeds_it(tok):
    script = lambda k, p: call("2*3") if k == 0 else "=66666666"  # noqa: E731
    prompt_len = len(tok.encode("2*3"))
    first = len(tok.encode(call("2*3"))) + 1
    frame = len(tok.encode("<tool_response>6</tool_response>"))
    for budget, runs in ((prompt_len + 5, [1]),  # cut inside the first turn
                         (prompt_len + first + 4, [1, 0]),  # cut inside the tool output
                         (prompt_len + first + frame + 3, [1, 0, 1])):  # cut inside the answer
        groups, *_ = _run(tok, script, n=1, max_total_tokens=budget)
        for s in (g[0] for g in groups):
            assert len(s.prompt_ids) + len(s.response_ids) == budget
            assert s.status == Status.TRUNCATED and s.extensions["multi_turn"]["truncated"]
            assert [m for _, _, m in _runs(s.loss_mask)] == runs


def test_answer_cut_by_max_new_tokens_is_truncated(tok):
    engine, env = ScriptedEngine(tok, lambda k, p: "=123456"), CalcEnv()
    params = SamplingParams(max_new_tokens=3)
    [[s]] = MultiTurnRollout().generate([Task("2*3")], 1, engine=engine, env=env, tokenizer=tok, params=params)
    assert s.status == Status.TRUNCATED and len(s.response_ids) == 3


def test_weight_versions_of_the_turns_collapse_repeats(tok):
    engine, env = ScriptedEngine(tok, lambda k, p: call("1") if k < 2 else "=1"), CalcEnv()
    orig = engine.generate

    def bump(prompts, params, n=1):
        out = orig(prompts, params, n)
        engine.weight_version += len(engine.calls) == 1  # the second and third turns on version 8
        return out
    engine.generate = bump
    [[s]] = MultiTurnRollout().generate([Task("1")], 1, engine=engine, env=env, tokenizer=tok, params=PARAMS)
    assert s.weight_versions == [7, 8] and s.weight_version == 7


def test_an_env_without_tools_is_a_clear_error(tok):
    class NoTools:
        def tasks(self, split):
            return []

        def reward(self, s):
            return 0.0
    with pytest.raises(MilesError, match="offers tools"):
        MultiTurnRollout().generate([Task("1")], 1, engine=None, env=NoTools(), tokenizer=tok, params=PARAMS)


def test_demonstration_is_laid_out_like_a_rollout(tok):
    msgs = [{"role": "assistant", "content": call("2*3")}, {"role": "tool", "content": "6"},
            {"role": "assistant", "content": "=6"}]
    ro = MultiTurnRollout()
    demo = ro.demonstration(Task("2*3", label="6"), msgs, tokenizer=tok, env=CalcEnv())
    groups, *_ = _run(tok, lambda k, p: call("2*3") if k == 0 else "=6", tasks=[Task("2*3")], n=1)
    s = groups[0][0]
    assert demo.prompt_ids == s.prompt_ids and demo.response_ids == s.response_ids
    assert demo.loss_mask == s.loss_mask and demo.logprobs == []
    assert demo.extensions["multi_turn"]["tool_calls"] == 1 and demo.response == s.response


def test_each_request_asks_only_for_what_its_own_budget_has_left(tok):
    """A server refuses prompt + max_new_tokens past the context length, so a long trajectory
    must not ask for a short one's room; trajectories with the same room share one request."""
    budget = 60
    engine, env = ScriptedEngine(tok, lambda k, p: call("2*3") if k == 0 else "=6"), CalcEnv()
    asked = []
    orig = engine.generate

    def check(prompts, params, n=1):
        asked.extend((len(p), params.max_new_tokens) for p in prompts)
        return orig(prompts, params, n)
    engine.generate = check
    tasks = [Task("2*3"), Task("1" * 12 + "*3"), Task("4*5")]
    ro = MultiTurnRollout(MultiTurnConfig(max_total_tokens=budget))
    groups = ro.generate(tasks, 2, engine=engine, env=env, tokenizer=tok, params=PARAMS)
    assert all(p + m <= budget for p, m in asked) and any(m < budget - 3 - 1 for _, m in asked)
    assert engine.calls[0] == (2, 2) and engine.calls[1] == (1, 2)  # turn one: short prompts together
    assert all(len(s.prompt_ids) + len(s.response_ids) <= budget for g in groups for s in g)


def test_show_prints_the_trajectories(tok, capsys):
    groups, *_ = _run(tok, lambda k, p: call("2*3") if k == 0 else "=6", n=1, show=1)
    samples = [g[0] for g in groups]
    for s in samples:
        s.reward = 1.0
    MultiTurnRollout(MultiTurnConfig(show=1)).metrics(samples)
    out = capsys.readouterr().out
    assert out.count("--- trajectory") == 1  # only the first sample
    assert f"task {samples[0].task.id}: reward 1, completed, 2 turn(s), 1 tool call(s)" in out
    lines = out.splitlines()[1:]
    assert lines == ["prompt:     2*3", f"assistant:  {call('2*3')}", '  call:     calc({"expression": "2*3"})',
                     "tool:       6", "answer:     =6"]
    MultiTurnRollout().metrics(samples)  # show: 0 prints nothing
    assert capsys.readouterr().out == ""
