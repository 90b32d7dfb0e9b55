"""The verifiers worker: a verifiers environment behind a small HTTP API for miles' connector.

Runs in verifiers' own virtualenv (``scripts/make_venv.sh``), never in miles' environment:

    $(plugins/envs/verifiers/scripts/make_venv.sh) plugins/envs/verifiers/worker/server.py --port 8100

It loads a ``SingleAgentEnv`` over a verifiers taskset (``--taskset``, default the bundled
``vf_arith``) on the local subprocess runtime, holds ``env.serving()`` (verifiers' interception
server) for its lifetime, and answers:

* ``GET /health`` -> ``{"ok": true, "taskset": ..., "size": N}``
* ``POST /tasks {"start": i, "count": n}`` -> ``{"tasks": [{"idx", "id", "prompt"}, ...]}``
* ``POST /rollout {"policy_url", "episodes": [{"idx": i}, ...], "sampling": {...}, "timeout_s"}``
  -> ``{"episodes": [...]}``: each task's episode run by ``env.run_episode`` against the policy's
  OpenAI-compatible server, scored by the task's rewards, with the policy's token-level reply
  (``prompt_ids``, ``completion_ids``, ``logprobs``, ``weight_version``, ``finish_reason``) or an
  ``error``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bundled taskset module

import httpx  # noqa: E402
import verifiers.v1 as vf  # noqa: E402
from aiohttp import web  # noqa: E402
from verifiers.v1.configs.client import EvalClientConfig  # noqa: E402

import vf_arith  # noqa: E402


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


def bad_address(host: str, port: int) -> str | None:
    """Why the worker cannot listen at ``host:port``, naming the flag and the fix; None when it can."""
    if not 0 < port < 65536:  # 0 would leave the worker's URL unknown to the connector
        return f"--port {port} is not a TCP port; pass one in 1..65535"
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        return f"--host {host}: cannot be resolved ({e.strerror}); pass an address of this machine, e.g. 127.0.0.1"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp: TIME_WAIT is no conflict
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"--port {port}: {host}:{port} is in use ({e.strerror}); pass a free --port or stop "
                        "what listens there")
            return f"--host {host}: cannot listen there ({e.strerror}); pass an address of this machine"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the verifiers worker for miles' verifiers connector")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--taskset", default="vf_arith", help="verifiers taskset id (an importable module)")
    ap.add_argument("--max-tasks", type=int, default=4096, help="taskset rows loaded at start")
    args = ap.parse_args(argv)
    # bad input is one line naming the flag (exit 2, argparse's usage errors), not a traceback
    problem = bad_address(args.host, args.port)
    if args.max_tasks < 1:
        problem = f"--max-tasks {args.max_tasks}: pass a positive number of taskset rows"
    if problem:
        ap.exit(2, f"{ap.prog}: error: {problem}\n")
    try:
        worker = Worker(args.taskset, args.max_tasks)
    except ImportError as e:  # verifiers' loader says which module it tried and where tasksets come from
        ap.exit(2, f"{ap.prog}: error: --taskset {args.taskset!r}: {e}\n")
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(worker.start)
    app.on_cleanup.append(worker.stop)
    app.router.add_get("/health", worker.health)
    app.router.add_post("/tasks", worker.list_tasks)
    app.router.add_post("/rollout", worker.rollout)
    print(f"verifiers worker ({args.taskset}, {len(worker.tasks)} tasks) on http://{args.host}:{args.port}",
          flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
