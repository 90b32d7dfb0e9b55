"""``vf_arith``: a verifiers taskset of one-digit additions, scored by its own ``@vf.reward``.

A verifiers taskset plugin (its module exports the ``Taskset`` and its default ``Harness`` via
``__all__``): rows are built in code from a seeded generator, so no dataset download is needed.
The harness is an in-process single-turn chat loop: it sends the task's prompt through the
rollout's interception endpoint (which records the exchange on the trace and relays it to the
policy) and keeps the provider's token-level reply (ids, log-probs, weight version) in
``TOKEN_REPLIES`` under the trace's id for the worker to return.
"""
from __future__ import annotations

import random
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

TOKEN_REPLIES: dict[str, dict[str, Any]] = {}  # trace id -> the policy's reply (choice 0)
SEED = 1234
MAX_KEPT = 65536


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        reply = trace.last_reply.strip() if trace.nodes else ""
        return 1.0 if reply == str(task.answer) else 0.0


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    """Rows ``a+b=`` with digits a, b from a fixed seed; row i is the same in every process."""

    SIZE = 10_000

    def load(self):
        rng = random.Random(SEED)
        for i in range(self.SIZE):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            yield ArithTask(ArithData(id=f"arith-{i}", prompt=f"{a}+{b}=", answer=a + b), self.config.task)


class ArithHarness(vf.Harness[vf.HarnessConfig]):
    """One chat turn, run in-process: no program to install, no container."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_: Any) -> ProgramResult:
        body = {"model": ctx.model, "messages": [{"role": "user", "content": data.prompt_text}],
                "logprobs": True}
        async with httpx.AsyncClient(timeout=None) as client:  # the rollout's own timeouts bound it
            r = await client.post(f"{endpoint.rstrip('/')}/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {secret}"})
        if r.status_code != 200:
            return ProgramResult(exit_code=1, stdout="", stderr=f"policy answered {r.status_code}: {r.text[:500]}")
        if len(TOKEN_REPLIES) >= MAX_KEPT:  # replies of episodes that timed out are never collected
            TOKEN_REPLIES.pop(next(iter(TOKEN_REPLIES)))
        TOKEN_REPLIES[trace.id] = r.json()["choices"][0]
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ArithTaskset", "ArithHarness"]
