"""The verifiers worker's HTTP handlers over a ``SingleAgentEnv`` (see ``server.py`` for the API).

Kept apart from ``server.py`` so that the command checks its flags before importing verifiers,
which takes seconds: a bad flag is reported at once.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import verifiers.v1 as vf
from aiohttp import web
from verifiers.v1.configs.client import EvalClientConfig

import vf_arith


class Worker:
    def __init__(self, taskset_id: str, max_tasks: int):
        cfg = vf.SingleAgentEnvConfig(taskset=vf.TasksetConfig(id=taskset_id),
                                      agent=vf.AgentConfig(runtime=vf.SubprocessConfig()))
        self.taskset_id = taskset_id
        self.env = vf.SingleAgentEnv(cfg)
        self.tasks = list(self.env.taskset.take(max_tasks))
        self.models: dict[str, str] = {}  # policy url -> the model id it serves
        self.stack = contextlib.AsyncExitStack()

    async def start(self, _app: web.Application) -> None:
        await self.stack.enter_async_context(self.env.serving())

    async def stop(self, _app: web.Application) -> None:
        await self.stack.aclose()

    async def health(self, _req: web.Request) -> web.Response:
        return web.json_response({"ok": True, "taskset": self.taskset_id, "size": len(self.tasks)})

    async def list_tasks(self, req: web.Request) -> web.Response:
        body = await req.json()
        start, count = int(body.get("start", 0)), int(body.get("count", 0))
        if start < 0 or count < 0 or start + count > len(self.tasks):
            return web.json_response({"error": f"rows {start}..{start + count - 1} asked, the taskset "
                                      f"{self.taskset_id!r} has {len(self.tasks)}"}, status=400)
        rows = [{"idx": i, "id": t.data.id, "prompt": t.data.prompt_text}
                for i, t in ((i, self.tasks[i]) for i in range(start, start + count))]
        return web.json_response({"tasks": rows})

    async def model_id(self, policy_url: str, timeout: float) -> str:
        if policy_url not in self.models:
            async with httpx.AsyncClient(timeout=timeout) as client:
                r = await client.get(f"{policy_url.rstrip('/')}/v1/models")
                r.raise_for_status()
                self.models[policy_url] = r.json()["data"][0]["id"]
        return self.models[policy_url]

    async def rollout(self, req: web.Request) -> web.Response:
        body = await req.json()
        policy_url = body["policy_url"].rstrip("/")
        timeout = float(body.get("timeout_s", 120))
        try:
            model = await self.model_id(policy_url, timeout)
        except Exception as e:  # noqa: BLE001 - reported to the connector, which fails the samples
            return web.json_response({"error": f"policy server {policy_url} unusable: {type(e).__name__}: {e}"},
                                     status=502)
        ctx = vf.ModelContext(model=model, client=EvalClientConfig(base_url=f"{policy_url}/v1"),
                              sampling=vf.SamplingConfig(**body.get("sampling", {})))
        eps = await asyncio.gather(*(self.episode(int(e["idx"]), ctx, timeout) for e in body["episodes"]))
        return web.json_response({"episodes": eps})

    async def episode(self, idx: int, ctx: Any, timeout: float) -> dict:
        if not 0 <= idx < len(self.tasks):
            return {"error": f"no task {idx} (the taskset has {len(self.tasks)})"}
        try:
            ep = await asyncio.wait_for(self.env.run_episode(self.tasks[idx], ctx), timeout)
        except Exception as e:  # noqa: BLE001 - one failed episode must not fail the others
            return {"error": f"{type(e).__name__}: {e}"}
        trace = ep.traces[0] if ep.traces else None
        reply = vf_arith.TOKEN_REPLIES.pop(trace.id, None) if trace is not None else None
        if not ep.ok or trace is None or reply is None:
            errors = "; ".join(f"{e}" for e in ep.errors) or (trace.last_error if trace else None)
            return {"error": f"episode failed: {errors or 'no policy reply recorded'}"}
        lps = ((reply.get("logprobs") or {}).get("content")) or []
        return {"reward": trace.reward, "rewards": {k: (r.score if r else None) for k, r in trace.rewards.items()},
                "text": trace.last_reply, "prompt_ids": reply.get("prompt_token_ids"),
                "completion_ids": reply.get("token_ids"), "logprobs": [x.get("logprob") for x in lps],
                "weight_version": reply.get("weight_version"), "finish_reason": reply.get("finish_reason")}
