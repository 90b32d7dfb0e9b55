"""A Harbor rollout (trial) turned into a sample's reward and token sequence.

The reward is the verifier's ``reward`` (or its only reward). Token data is the agent's first
``rollout_details`` entry (the main conversation): per turn the full prompt, the completion's
token ids and log-probs. Turn ``k``'s prompt must extend turn ``k-1``'s prompt and completion; the
tokens in between (command output, chat framing) get loss_mask 0 and log-prob 0.0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


class BadTrial(Exception):
    """The trial failed, or its result has no usable reward or token data."""


@dataclass
class Trial:
    reward: float
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0
    weight_versions: list[int] = field(default_factory=list)


def trial_reward(rollout: dict) -> float:
    if rollout.get("error_type"):
        raise BadTrial(f"the trial failed: {rollout['error_type']}{_exception(rollout)}")
    rewards = rollout.get("rewards") or {}
    value = rewards.get("reward", next(iter(rewards.values())) if len(rewards) == 1 else None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadTrial(f"the verifier recorded no usable reward (rewards {rewards!r})")
    return float(value)


def parse_trial(rollout: dict, need_tokens: bool) -> Trial:
    """Reward and token sequence of a finished rollout detail (``BadTrial`` with the reason)."""
    trial = Trial(reward=trial_reward(rollout))
    details = ((rollout.get("result") or {}).get("agent_result") or {}).get("rollout_details") or []
    if not details:
        if need_tokens:
            raise BadTrial("the agent recorded no token ids (rollout_details); use an agent that "
                           "collects them (terminus-2 with collect_rollout_details: true)")
        return trial
    d = details[0]
    prompts, completions, lps = d.get("prompt_token_ids"), d.get("completion_token_ids"), d.get("logprobs")
    if not (isinstance(prompts, list) and isinstance(completions, list) and isinstance(lps, list)
            and len(prompts) == len(completions) == len(lps) and prompts):
        raise BadTrial("rollout_details needs prompt_token_ids, completion_token_ids and logprobs, one per turn")
    seen: list[int] = list(prompts[0])
    trial.prompt_ids = list(seen)
    for prompt, gen, lp in zip(prompts, completions, lps):
        if len(gen) != len(lp):
            raise BadTrial(f"turn {trial.turns + 1}: {len(gen)} completion tokens but {len(lp)} log-probs")
        if list(prompt[:len(seen)]) != seen:
            raise BadTrial(f"turn {trial.turns + 1}'s prompt does not extend the earlier turns' tokens")
        between = list(prompt[len(seen):])
        trial.response_ids += between + list(gen)
        trial.logprobs += [0.0] * len(between) + [float(x) for x in lp]
        trial.loss_mask += [0] * len(between) + [1] * len(gen)
        seen = list(prompt) + list(gen)
        trial.turns += 1
    versions = (d.get("extra") or {}).get("weight_version")
    if isinstance(versions, list) and versions and all(isinstance(v, int) and not isinstance(v, bool)
                                                      for v in versions):
        trial.weight_versions = list(versions)
    return trial


def _exception(rollout: dict) -> str:
    info = (rollout.get("result") or {}).get("exception_info") or {}
    msg = info.get("exception_message") if isinstance(info, dict) else None
    return f" ({str(msg)[:300]})" if msg else ""
