"""The ``multi_turn`` rollout: generate, run the tool calls, append their output, generate again.

Every live trajectory of a step is advanced by one batched ``engine.generate`` call per turn.
Token in, token out: a sample is one token sequence whose model tokens are the engine's own ids
and log-probs (``loss_mask`` 1) and whose tool tokens are appended by the rollout (``loss_mask``
0, log-prob 0.0); ``response_ids`` is everything after the prompt. Per-sample counts go to
``Sample.extensions["multi_turn"]`` (``turns``, ``tool_calls``, ``tool_errors``, ``truncated``,
``final_response``: the text of the model's last turn, ``messages``: the turns and tool results
as text); ``metrics(samples)`` aggregates them and prints ``rollout.show`` trajectories. The
engine's ``Completion.extras`` of every turn are stitched into the sample's other extensions
(``extras``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from miles import Sample, SamplingParams, Task
from miles.protocols import OffersTools
from miles.types import Status

from .config import MultiTurnConfig
from .extras import StitchedExtras
from .framing import encode_prompt, has_chat_template, tool_frame
from .parsing import ToolCall, parse_tool_calls
from .transcript import render
from .tools import tool_env

KEY = "multi_turn"


@dataclass
class _Trajectory:
    task: Task
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    errors: int = 0
    last_text: str = ""
    messages: list[dict] = field(default_factory=list)  # {"role": "assistant" | "tool", "content"}
    extras: StitchedExtras = field(default_factory=StitchedExtras)
    status: Status | None = None  # set when the trajectory ends

    def extend(self, ids: Sequence[int], logprobs: Sequence[float] | None, trained: int) -> None:
        self.ids += ids
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.mask += [trained] * len(ids)


class MultiTurnRollout:
    """``miles.protocols.Rollout`` for tool use. See the module docstring."""

    def __init__(self, cfg: MultiTurnConfig | None = None):
        self.cfg = cfg or MultiTurnConfig()

    # -- the loop ---------------------------------------------------------------------------------
    def generate(self, tasks: Sequence[Task], n: int, *, engine: Any, env: Any, tokenizer: Any,
                 params: SamplingParams) -> list[list[Sample]]:
        env = tool_env(env)
        use_template = self._use_template(tokenizer)
        prompts = [encode_prompt(tokenizer, t.prompt, env.tools(), use_template) for t in tasks]
        trajs = [_Trajectory(t, p) for t, p in zip(tasks, prompts) for _ in range(n)]
        for t in trajs:
            if self._room(t) <= 0:
                t.status = Status.TRUNCATED  # the prompt alone fills the budget
        turn = 0
        while live := [t for t in trajs if t.status is None]:
            if turn == 0 and len(live) == len(trajs):  # one prompt, n samples: the engine can share it
                heads = [trajs[i * n] for i in range(len(tasks))]
                outs = self._turn(engine, heads, params, turn, n)
                done = [(t, c) for i, h in enumerate(heads) for t, c in zip(trajs[i * n:(i + 1) * n], outs[id(h)])]
            else:
                outs = self._turn(engine, live, params, turn, 1)
                done = [(t, outs[id(t)][0]) for t in live]
            for t, c in done:
                self._advance(t, c, env, tokenizer, use_template)
            turn += 1
        return [[self._sample(t, tokenizer) for t in trajs[i * n:(i + 1) * n]] for i in range(len(tasks))]

    def _turn(self, engine: Any, trajs: list[_Trajectory], params: SamplingParams, turn: int,
              n: int) -> dict[int, list]:
        """One turn's completions of ``trajs`` (``n`` each), keyed by ``id(trajectory)``. Each
        request asks for at most what is left of its own token budget, because servers refuse a
        prompt whose ``max_new_tokens`` would pass the context length (SGLang, ``miles serve``):
        trajectories are batched by that cap, the largest cap first."""
        groups: dict[int, list[_Trajectory]] = {}
        for t in trajs:
            groups.setdefault(min(params.max_new_tokens, self._room(t)), []).append(t)
        outs: dict[int, list] = {}
        for k, cap in enumerate(sorted(groups, reverse=True)):
            seed = None if params.seed is None else params.seed + turn + 100_003 * k
            batch = groups[cap]
            answers = engine.generate([t.prompt_ids + t.ids for t in batch],
                                      replace(params, max_new_tokens=cap, seed=seed), n=n)
            outs.update((id(t), cs) for t, cs in zip(batch, answers))
        return outs

    def _use_template(self, tokenizer: Any) -> bool:
        return self.cfg.chat_template == "auto" and has_chat_template(tokenizer)

    def _room(self, t: _Trajectory) -> int:
        return self.cfg.max_total_tokens - len(t.prompt_ids) - len(t.ids)

    def _advance(self, t: _Trajectory, c: Any, env: Any, tokenizer: Any, use_template: bool) -> None:
        """One model turn of ``t`` (completion ``c``): keep its tokens, then end the trajectory
        or run its tool calls and append their framed output."""
        room, prefix_len = self._room(t), len(t.prompt_ids) + len(t.ids)
        ids, lps = list(c.token_ids[:room]), list(c.logprobs[:room])
        cut = len(ids) < len(c.token_ids)  # the batch's longest budget let this one run past its own
        t.extend(ids, lps, 1)
        t.extras.add(c.extras, prefix_len, len(c.token_ids), prefix_len + len(ids))
        t.turns += 1
        t.versions += list(c.weight_versions or [c.weight_version])
        t.last_text = tokenizer.decode(ids, skip_special_tokens=True)
        t.messages.append({"role": "assistant", "content": t.last_text})
        if c.finish_reason == "abort":
            t.status = Status.ABORTED
            return
        calls = parse_tool_calls(t.last_text, self.cfg.tool_format)
        t.calls += len(calls)
        if not calls:  # an answer
            t.status = Status.COMPLETED if c.finish_reason == "stop" and not cut else Status.TRUNCATED
            return
        if t.turns >= self.cfg.max_turns or cut:  # no turn left to use the tool's answer
            t.status = Status.TRUNCATED
            return
        outputs = [self._call(env, call, t) for call in calls]
        t.messages += [{"role": "tool", "content": o} for o in outputs]
        frame = tool_frame(tokenizer, outputs, self.cfg.tool_result_template, use_template)
        room = self._room(t)
        t.extend(frame[:room], None, 0)
        if len(frame) >= room:  # no token left for the model to answer with
            t.status = Status.TRUNCATED

    def _call(self, env: Any, call: ToolCall, t: _Trajectory) -> str:
        if call.error is None:
            try:
                out = str(env.call_tool(call.name, call.arguments, t.task))
            except Exception as e:  # the tool's error is the model's feedback, not the run's
                call = replace(call, error=str(e) or type(e).__name__)
        if call.error is not None:
            t.errors += 1
            out = f"error: {call.error}"
        return out[:self.cfg.max_tool_output_chars]

    def _sample(self, t: _Trajectory, tokenizer: Any) -> Sample:
        versions = [v for i, v in enumerate(t.versions) if i == 0 or v != t.versions[i - 1]]
        ext = {"turns": t.turns, "tool_calls": t.calls, "tool_errors": t.errors,
               "truncated": t.status == Status.TRUNCATED, "final_response": t.last_text,
               "messages": t.messages}
        extensions = {**t.extras.extensions(len(t.prompt_ids) + len(t.ids)), KEY: ext}
        return Sample(task=t.task, prompt_ids=t.prompt_ids, response_ids=t.ids,
                      response=tokenizer.decode(t.ids, skip_special_tokens=True), logprobs=t.logprobs,
                      loss_mask=t.mask, status=t.status, weight_version=min(versions, default=0),
                      weight_versions=versions, extensions=extensions)

    # -- metrics and demonstrations ---------------------------------------------------------------
    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Means over the samples this rollout made: turns, tool calls and tool errors per sample,
        and the share that ran out of turns or tokens. With ``rollout.show: N`` the first N of
        them are also printed as transcripts (``miles eval CONFIG rollout.show=N``)."""
        ext = [s.extensions[KEY] for s in samples if KEY in s.extensions]
        if not ext:
            return {}
        shown = [s for s in samples if KEY in s.extensions][:self.cfg.show]
        for i, s in enumerate(shown):
            print(render(s, self.cfg.tool_format, f"{i + 1}/{len(shown)}"), flush=True)
        k = len(ext)
        return {"turns_mean": sum(e["turns"] for e in ext) / k,
                "tool_calls_mean": sum(e["tool_calls"] for e in ext) / k,
                "tool_errors": sum(e["tool_errors"] for e in ext) / k,
                "truncated_frac": sum(bool(e["truncated"]) for e in ext) / k}

    def demonstration(self, task: Task, messages: Sequence[dict], *, tokenizer: Any, env: Any = None,
                      version: int = 0) -> Sample:
        """A multi-turn demonstration as a training sample laid out exactly as this rollout lays
        out its samples: ``messages`` alternate ``{"role": "assistant", "content": ...}`` turns
        (trained on, each ended by the tokenizer's EOS like a generated turn) and ``{"role":
        "tool", "content": ...}`` results (framed, ``loss_mask`` 0)."""
        use_template = self._use_template(tokenizer)
        tools = env.tools() if isinstance(env, OffersTools) else None
        t = _Trajectory(task, encode_prompt(tokenizer, task.prompt, tools or [], use_template))
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        pending: list[str] = []
        for m in list(messages) + [{"role": "assistant", "content": None}]:
            if m["role"] == "tool":
                pending.append(str(m["content"])[:self.cfg.max_tool_output_chars])
                continue
            if pending:
                t.extend(tool_frame(tokenizer, pending, self.cfg.tool_result_template, use_template), None, 0)
                pending = []
            if m["content"] is not None:
                t.extend(list(tokenizer.encode(m["content"], add_special_tokens=False)) + eos, None, 1)
                t.turns += 1
                t.last_text = m["content"]
        t.status = Status.COMPLETED
        t.versions = [version]
        t.messages = [dict(m) for m in messages]
        t.calls = sum(len(parse_tool_calls(m["content"], self.cfg.tool_format))
                      for m in messages if m["role"] == "assistant")
        return replace(self._sample(t, tokenizer), logprobs=[])  # no engine produced these tokens
