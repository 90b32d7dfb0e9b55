"""A NeMo Gym ``/run`` answer turned into ONE token sequence for the trainer.

NeMo Gym puts the token data of each model call on the last output item that call produced:
``prompt_token_ids`` (everything the policy saw), ``generation_token_ids`` and
``generation_log_probs`` (what it produced). Turn ``k``'s prompt must extend turn ``k-1``'s
prompt plus generation; the tokens in between (tool outputs, the chat template's framing) are
appended with loss_mask 0 and log-prob 0.0, and each generation keeps the engine's ids and
log-probs with loss_mask 1, so nothing is re-tokenized.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class MalformedTrajectory(Exception):
    """The answer has no usable reward or token data."""


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    truncated: bool = False
    text: str = ""


def parse_run(answer: dict) -> Trajectory:
    """The token sequence, reward and final text of one ``/run`` answer (``MalformedTrajectory``
    when a part is missing, of the wrong type, or the turns do not line up)."""
    reward = answer.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise MalformedTrajectory(f"reward is {reward!r}, not a finite number")
    response = answer.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    if not isinstance(output, list):
        raise MalformedTrajectory("no response.output list in the /run answer")
    calls = [item for item in output if isinstance(item, dict) and "generation_token_ids" in item]
    if not calls:
        raise MalformedTrajectory("no output item carries generation_token_ids: the model server must "
                                  "return token data (miles_model, return_token_id_information: true)")
    traj = Trajectory(prompt_ids=_ints(calls[0], "prompt_token_ids"), reward=float(reward))
    seen = list(traj.prompt_ids)
    for item in calls:
        prompt, gen = _ints(item, "prompt_token_ids"), _ints(item, "generation_token_ids")
        lps = item.get("generation_log_probs")
        if not isinstance(lps, list) or len(lps) != len(gen) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps):
            raise MalformedTrajectory(f"generation_log_probs does not match {len(gen)} generation tokens")
        if prompt[:len(seen)] != seen:
            raise MalformedTrajectory(f"turn {traj.turns + 1}'s prompt does not extend the earlier "
                                      "turns' tokens (the chat template re-renders them differently)")
        between = prompt[len(seen):]
        traj.response_ids += between + gen
        traj.logprobs += [0.0] * len(between) + [float(x) for x in lps]
        traj.loss_mask += [0] * len(between) + [1] * len(gen)
        seen = prompt + gen
        traj.turns += 1
    traj.truncated = bool(response.get("incomplete_details"))
    traj.text = _final_text(output)
    return traj


def _ints(item: dict, key: str) -> list[int]:
    value = item.get(key)
    try:
        if not isinstance(value, list):
            raise TypeError
        return [int(v) for v in value]
    except (TypeError, ValueError):
        raise MalformedTrajectory(f"{key} of a {item.get('type')!r} output item is not a list of "
                                  f"token ids: {value!r:.100}") from None


def _final_text(output: list[Any]) -> str:
    text = ""
    for item in output:
        if isinstance(item, dict) and item.get("type") == "message" and item.get("role") == "assistant":
            text = "".join(p.get("text") or "" for p in item.get("content") or [] if isinstance(p, dict))
    return text
