"""Multiplication problems that need a tool, their verifier, a sloppy teacher's transcripts.

Prompt ``"347*86"``; the answer is written ``=N`` at the end of the model's last turn
(``"=29842"``). A tiny model cannot multiply in its head, but it can copy the factors into a
calculator call and copy the result out:

    347*86<tool_call>{"name": "calculator", "arguments": {"expression": "347*86"}}</tool_call>
    <tool_response>29842</tool_response>=29842

The teacher mostly answers from a head estimate (``=24000``: the leading digits multiplied), so
supervised training on its transcripts gives a model that, greedily, estimates; an exact-match
reward then teaches it to call the tool.
"""
from __future__ import annotations

import random
import re
from typing import Any

from miles import MilesError, Sample, Task

from .config import ToolUseConfig
from .tools import CALCULATOR, PYTHON, ToolError, calculator, run_python_tool, sandbox_available

CHARS = "0123456789+-*/%().=,:;!?'_[]{}<>\" \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
CALL_OPEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}</tool_call>'
# whole-word tokens for the tool-call markup, so a call costs the tiny model ~10 tokens
WORDS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
         '{"name": "calculator", "arguments": {"expression": "', '"}}']
_ANSWER = re.compile(r"=\s*(-?\d+)\s*$")


def tool_tokenizer() -> Any:
    """A Hugging Face fast tokenizer: one token per character plus the tool-call markup words
    (built locally, no hub; no chat template, so tool results use the rollout's text frame)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # characters join without spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in WORDS])
    return tok


def answer_of(text: str) -> str | None:
    """The ``=N`` answer at the end of a turn, or None."""
    m = _ANSWER.search(text)
    return m.group(1) if m else None


class ToolUseEnv:
    def __init__(self, cfg: ToolUseConfig, seed: int = 0):
        self.cfg = cfg
        rng = random.Random(cfg.data_seed)
        lo_a, lo_b = 10 ** (cfg.a_digits - 1), 10 ** (cfg.b_digits - 1)
        space = (9 * lo_a) * (9 * lo_b)
        if cfg.train_size + cfg.eval_size > space:
            raise MilesError(f"env.train_size + env.eval_size = {cfg.train_size + cfg.eval_size} exceeds the "
                             f"{space} distinct problems of a_digits={cfg.a_digits}, b_digits={cfg.b_digits}; "
                             f"lower them")
        picked = rng.sample(range(space), cfg.train_size + cfg.eval_size)
        pairs = [(lo_a + k // (9 * lo_b), lo_b + k % (9 * lo_b)) for k in picked]
        self.splits = {"eval": [self._task(a, b) for a, b in pairs[:cfg.eval_size]],
                       "train": [self._task(a, b) for a, b in pairs[cfg.eval_size:]]}
        teacher = random.Random(cfg.data_seed + 1)
        self.demos = [(t, self._teacher(t, teacher)) for t in self.splits["train"] for _ in range(cfg.demos_per_task)]
        self._tok = None

    @staticmethod
    def _task(a: int, b: int) -> Task:
        return Task(prompt=f"{a}*{b}", label=str(a * b), metadata={"a": a, "b": b}, id=f"{a}*{b}")

    # -- the teacher ----------------------------------------------------------------------------
    @staticmethod
    def estimate(a: int, b: int) -> int:
        """The teacher's head estimate: leading digits multiplied, the other places zeros."""
        sa, sb = str(a), str(b)
        return int(sa[0]) * int(sb[0]) * 10 ** (len(sa) + len(sb) - 2)

    def _teacher(self, task: Task, rng: random.Random) -> list[dict]:
        a, b, cfg = task.metadata["a"], task.metadata["b"], self.cfg
        guess = [{"role": "assistant", "content": f"={self.estimate(a, b)}"}]
        if rng.random() >= cfg.teacher_tool_rate:
            return guess
        expr = f"{a}*{b}"
        if rng.random() < cfg.teacher_bad_call_rate:
            if rng.random() < 0.5:  # malformed: the closing quote and braces are forgotten
                return [{"role": "assistant", "content": f"{CALL_OPEN}{expr}</tool_call>"},
                        {"role": "tool", "content": "error: invalid JSON in tool call"}] + guess
            i = rng.randrange(len(expr.split("*")[0]))  # a mistyped digit of the first factor
            expr = expr[:i] + str((int(expr[i]) + rng.randrange(1, 9)) % 10 or 1) + expr[i + 1:]
        result = calculator(expr)
        return [{"role": "assistant", "content": f"{CALL_OPEN}{expr}{CALL_CLOSE}"},
                {"role": "tool", "content": result},
                {"role": "assistant", "content": f"={result}"}]

    # -- the env protocol -----------------------------------------------------------------------
    def tasks(self, split: str) -> list[Task]:
        return self.splits[split]

    def reward(self, sample: Sample) -> float:
        """1 when the model's last turn ends with ``=N`` and N is the exact product."""
        final = sample.extensions.get("multi_turn", {}).get("final_response", sample.response)
        return 1.0 if answer_of(final) == sample.task.label else 0.0

    def demonstrations(self) -> list[tuple[Task, list[dict]]]:
        """``(task, messages)``: assistant turns and tool results (a multi-turn transcript)."""
        return self.demos

    def tokenizer(self) -> Any:
        if self._tok is None:
            self._tok = tool_tokenizer()
        return self._tok

    # -- tools (miles.protocols.OffersTools) ------------------------------------------------------
    def tools(self) -> list[dict]:
        python = self.cfg.python_tool == "auto" and sandbox_available()
        return [CALCULATOR] + ([PYTHON] if python else [])

    def call_tool(self, name: str, arguments: dict, task: Task) -> str:
        if name == "calculator":
            return calculator(arguments.get("expression"))
        if name == "python" and any(t["function"]["name"] == "python" for t in self.tools()):
            return run_python_tool(arguments.get("code"), self.cfg.python_timeout_s)
        raise ToolError(f"unknown tool {name!r}; tools: {', '.join(t['function']['name'] for t in self.tools())}")
