"""Advantage estimators: group baselines (GRPO, Dr.GRPO, REINFORCE++-baseline), per-token
returns (REINFORCE++) and GAE (PPO).

Sources of the formulas (facts, not code): Miles/slime ``loss_hub`` and its reward
post-processing, the REINFORCE++ paper (Hu 2025), GAE (Schulman et al. 2016).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

STD_EPS = 1e-6


def group_advantages(rewards: Sequence[float], std_normalize: bool = True) -> list[float]:
    """Advantages of one group of samples of the same prompt: ``r - mean(r)``, divided by
    ``std + 1e-6`` (unbiased std) when ``std_normalize`` and the std is positive.

    ``std_normalize=True`` is GRPO; ``False`` is Dr.GRPO's and REINFORCE++-baseline's centring.
    A group whose rewards are all equal gets zeros.

    A single-sample group gets ``[0.0]``. Its only baseline is itself (``r - mean(r) = 0``, as in
    Miles' reward post-processing) and its std is undefined; passing the raw reward through
    instead would make that sample's advantage depend on the reward's offset (a reward of
    ``r + c`` would push differently from ``r``, which no other group does), on a scale unrelated
    to the normalised advantages beside it. Algorithms that want a lone sample to carry signal
    use a learned baseline (``ppo``) or batch whitening (``reinforce_pp`` without baseline).
    """
    r = [float(x) for x in rewards]  # plain floats: groups are tiny, tensors cost more than math
    if len(r) < 2:
        return [0.0] * len(r)
    mean = sum(r) / len(r)
    adv = [x - mean for x in r]
    if std_normalize:
        std = math.sqrt(sum(a * a for a in adv) / (len(r) - 1))
        if std > 0:
            adv = [a / (std + STD_EPS) for a in adv]
    return adv


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` index of each row's last token with mask 1 (0 for a row without any)."""
    R = mask.shape[-1]
    pos = torch.arange(R, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, pos, torch.zeros_like(pos)).max(-1).values


def terminal_rewards(outcome: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` zeros with each row's ``outcome`` ``[B]`` at its last trainable token."""
    out = torch.zeros_like(mask, dtype=outcome.dtype)
    rows = mask.sum(-1) > 0
    idx = last_token_index(mask)
    out[rows, idx[rows]] = outcome[rows]
    return out


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t'}`` where ``t'`` is the next trainable token (REINFORCE++).

    Tokens with mask 0 (tool output) are not decision steps: no reward is read there, no
    discount is applied across them, and their return is 0.
    """
    running = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    for t in range(rewards.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over trainable tokens only (as Miles does).

    ``delta_t = r_t + gamma * V_{t'} - V_t``, ``A_t = delta_t + gamma * lam * A_{t'}`` with ``t'``
    the next trainable token (``V = A = 0`` after the last one: the episode ends there);
    returns ``(advantages, returns)`` with ``returns = A + V``; both 0 where mask is 0.
    """
    next_v = torch.zeros_like(values[:, 0])
    next_a = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        next_a = torch.where(m, a, next_a)
        next_v = torch.where(m, values[:, t], next_v)
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
    return adv, (adv + values) * mask
