"""A Harbor agent that plays a task with a policy served by miles and records its exact tokens.

Runs inside Harbor (its Python 3.12 venv, where ``python -m miles_plugin_harbor.launch`` installs
it): ``harbor run -a miles_harbor_agent:MilesAgent --ak policy_url=... --ak tokenizer_dir=...``
or, through ``harbor serve``, ``AgentConfig(import_path="miles_harbor_agent:MilesAgent",
kwargs={...})``. Each turn it sends the conversation's token ids to the policy server's ``/generate``
(miles serve or SGLang), runs the reply as a shell command in the trial's environment
(``environment.exec``) and appends the command's output as the next user turn. The policy's token
ids and log-probs are kept exactly as the server returned them (the reply's text is only read to
find the command, never tokenized again); the turns go to ``context.rollout_details`` (Harbor's
per-turn prompt ids, completion ids and log-probs), and each raw server answer to
``miles_turns.jsonl`` in the agent's log folder.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
from harbor.agents.base import BaseAgent
from harbor.agents.options import AgentOptions
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from pydantic import Field

from miles_harbor_chat import ChatTokens

NAME = "miles"


class MilesAgentOptions(AgentOptions):
    policy_url: str = Field(description="base URL of the policy server (miles serve or SGLang), whose "
                            "/generate takes input_ids and returns output_ids with their log-probs")
    tokenizer_dir: str = Field(description="the served model's folder on this machine: tokenizer.json and "
                               "the chat template (tokenizer_config.json or chat_template.jinja)")
    max_turns: int = Field(4, ge=1, description="policy replies per trial")
    max_new_tokens: int = Field(64, ge=1, description="token limit of one reply")
    max_context_tokens: int = Field(4096, ge=8, description="the trial ends before a turn whose prompt "
                                    "plus max_new_tokens would exceed this (the served model's context)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of every reply")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling threshold")
    top_k: int = Field(0, description="top-k sampling (0 or less: off)")
    system_prompt: str | None = Field(None, description="a system message before the task's instruction")
    cwd: str | None = Field(None, description="working directory of the commands (default: the image's)")
    observation_chars: int = Field(1000, ge=1, description="a command's output beyond this is cut")
    command_timeout_sec: int = Field(30, ge=1, description="seconds one command may run in the environment")
    request_timeout_sec: float = Field(120.0, gt=0, description="seconds one /generate call may take")
    api_key_env: str = Field("MILES_API_KEY", description="environment variable with the policy "
                             "server's API key, sent as a bearer token when set")


class MilesAgent(BaseAgent):
    options_model = MilesAgentOptions

    @staticmethod
    def name() -> str:
        return NAME

    def version(self) -> str:
        return "0.1.0"

    async def setup(self, environment: BaseEnvironment) -> None:
        self.chat = ChatTokens(Path(self.options.tokenizer_dir))

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        opts: MilesAgentOptions = self.options
        chat = getattr(self, "chat", None) or ChatTokens(Path(opts.tokenizer_dir))
        messages = ([{"role": "system", "content": opts.system_prompt}] if opts.system_prompt else [])
        messages.append({"role": "user", "content": instruction})
        ids = chat.prompt(messages)
        turns: dict[str, list] = {"prompt_token_ids": [], "completion_token_ids": [], "logprobs": []}
        versions, log = [], Path(self.logs_dir) / "miles_turns.jsonl"
        headers = {"Authorization": f"Bearer {os.environ[opts.api_key_env]}"} if os.environ.get(
            opts.api_key_env) else {}
        try:
            async with httpx.AsyncClient(base_url=opts.policy_url, timeout=opts.request_timeout_sec,
                                         trust_env=False, headers=headers) as client:
                for turn in range(opts.max_turns):
                    if len(ids) + opts.max_new_tokens > opts.max_context_tokens:
                        break
                    out = await self._generate(client, ids)
                    gen, lps, version = _tokens(out)
                    with log.open("a") as f:
                        f.write(json.dumps({"turn": turn, "input_ids": ids, "response": out}) + "\n")
                    turns["prompt_token_ids"].append(list(ids))
                    turns["completion_token_ids"].append(gen)
                    turns["logprobs"].append(lps)
                    versions.append(version)
                    ids = ids + gen
                    reply = chat.decode(gen)
                    command = reply.strip()
                    if not command:
                        break  # an empty reply submits
                    observation = await self._execute(environment, command)
                    if turn == opts.max_turns - 1:
                        break  # the last command ran; no reply reads its output
                    messages.append({"role": "assistant", "content": reply})
                    ids = ids + chat.next_turn(messages, {"role": "user", "content": observation}, gen)
                    messages.append({"role": "user", "content": observation})
        finally:  # the turns played so far, also when the policy server failed mid-trial
            if turns["completion_token_ids"]:
                turns["extra"] = {"weight_version": versions}
                context.rollout_details = [turns]
                context.n_input_tokens = sum(len(p) for p in turns["prompt_token_ids"])
                context.n_output_tokens = sum(len(c) for c in turns["completion_token_ids"])
            context.metadata = {**(context.metadata or {}), "turns": len(turns["completion_token_ids"])}

    async def _generate(self, client: httpx.AsyncClient, ids: list[int]) -> dict:
        opts: MilesAgentOptions = self.options
        sampling = {"temperature": opts.temperature, "top_p": opts.top_p, "max_new_tokens": opts.max_new_tokens}
        if opts.top_k > 0:
            sampling["top_k"] = opts.top_k
        body = {"input_ids": ids, "return_logprob": True, "sampling_params": sampling}
        r = await client.post("/generate", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"policy server {opts.policy_url}/generate answered HTTP {r.status_code}: "
                               f"{r.text[:500]}")
        out = r.json()
        return out[0] if isinstance(out, list) else out

    async def _execute(self, environment: BaseEnvironment, command: str) -> str:
        opts: MilesAgentOptions = self.options
        try:
            res = await environment.exec(command, cwd=opts.cwd, timeout_sec=opts.command_timeout_sec)
            text = f"exit {res.return_code}\n{res.stdout or ''}{res.stderr or ''}"
        except Exception as e:  # noqa: BLE001 (a command that timed out or broke the exec is an observation)
            text = f"error {type(e).__name__}: {e}"
        return text[:opts.observation_chars]


def _tokens(out: dict) -> tuple[list[int], list[float], int | None]:
    """The reply's token ids, their log-probs and the weight version, as ``/generate`` returned them."""
    meta = out.get("meta_info") or {}
    gen = out.get("output_ids")
    pairs = meta.get("output_token_logprobs")
    if not isinstance(gen, list) or not isinstance(pairs, list) or len(pairs) != len(gen):
        raise RuntimeError(f"/generate returned no output_ids with one log-prob each: {str(out)[:300]}")
    if [p[1] for p in pairs] != gen:
        raise RuntimeError("/generate's output_token_logprobs do not follow its output_ids")
    return [int(t) for t in gen], [float(p[0]) for p in pairs], meta.get("weight_version")
